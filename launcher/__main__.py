import gc
import sys

from launcher.cli import main

code = main()
# Skip the collection of every object at interpreter exit (over a second here): nothing is left to clean up.
gc.freeze()
sys.exit(code)
