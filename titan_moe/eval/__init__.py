"""Evaluations run by the trainer (long context at the end of a stage)."""
