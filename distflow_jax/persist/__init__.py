"""Persistence: checkpoints (orbax, file records, contents, resume), their checksums, and
the actor's export from a checkpoint as a Hugging Face folder.  It may import state/ and the
layers below it; never observe/, warmstart/, run/ or the commands.
"""
