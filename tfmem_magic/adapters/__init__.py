"""The surfaces: IPython magics, the command line, argument parsing, the demo."""
