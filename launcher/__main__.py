import gc
import sys

if sys.argv[1:2] == ["drain"]:  # a command to a running job: without the launcher's imports
    from launcher.drain import main

    sys.exit(main(sys.argv[2:]))

from launcher.cli import main

code = main()
# Skip the collection of every object at interpreter exit (over a second here): nothing is left to clean up.
gc.freeze()
sys.exit(code)
