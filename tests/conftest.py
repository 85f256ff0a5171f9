"""The deeper tests' models: in the repository, under tests/models/, each with its PROVENANCE.md.

stories260K carries llama2.c's greedy tokens; the transformers-made tiny checkpoints carry transformers'
tokens and logits. `helpers.model_path` finds them; a missing model is an error, never a skip.
"""
