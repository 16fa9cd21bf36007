"""Fixtures' helpers; the ones with a ``__main__`` run as torchrun ranks (``python -m tests.helpers.X``)."""
from longlive_core.progress import freeze_at_exit

freeze_at_exit()  # each rank's process ends without collecting its heap's cycles, as a stage's does
