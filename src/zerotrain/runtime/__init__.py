"""Processes: launching ranks locally or under torchrun, supervising them, their failures, the run folder."""
