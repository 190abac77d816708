"""Self-study content: what the synthetic conversations are about and how they are checked.

It owns the seed prompts and the degenerate-message filter (`seeds`), the rules every
planner of document spans shares (`spans`), and fact coverage, the sentences a training
conversation is grounded in (`facts`). The stages that generate and store conversations
live in `stages/`; the model calls they make live in the core.
"""
