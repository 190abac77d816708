"""The `cartridges` command line: the entry point that runs the engine, the stages and the flows.

- `main`: the parser, the engine and pipeline commands, and the one place user errors are printed
- `fleet`: `fleet`, `retrain` and `ask --fleet`
- `common`: the command registry and the flags every command shares
- `docs`: renders docs/CLI.md from the parser
"""
