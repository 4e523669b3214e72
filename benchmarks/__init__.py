"""`linearize bench`: the end-to-end benchmark harness (see cli.py for what it measures). A tool beside the
library: nothing in linearize/, kernels/ or recipes/ imports it; the CLI reaches it through
``linearize.cli.COMMAND_MODULES``."""
