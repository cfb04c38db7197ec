import gc
import importlib
import sys

COMMANDS = {
    "drain": "launcher.drain",
    "export": "launcher.export",
    "ls": "launcher.recipe_commands",
    "cp": "launcher.recipe_commands",
    "validate": "launcher.recipe_commands",
}
"""`python -m launcher <command> ...`: each command's module has `main(argv) -> int` (argv[0] is the command)."""

if sys.argv[1:2] and sys.argv[1] in COMMANDS:
    sys.exit(importlib.import_module(COMMANDS[sys.argv[1]]).main(sys.argv[1:]))

code = importlib.import_module("launcher.cli").main()
# Skip the collection of every object at interpreter exit (over a second here): nothing is left to clean up.
gc.freeze()
sys.exit(code)
