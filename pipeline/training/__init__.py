"""Training a learned drafter for the user's own target: prompts, self-distillation data, the head.

Nothing here runs while serving; `speclanes drafter train` drives it (`training.cli`).
"""
