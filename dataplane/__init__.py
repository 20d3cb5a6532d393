"""The data plane: one service per job that owns every source's file state, mixes sources by
schedule, plans every step for every rank, and records what each step consumed."""
