"""`longlive plan`: hours and GPU-hours per stage for a run, from measured per-unit rates."""
