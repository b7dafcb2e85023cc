"""Scripts run on every rank, by a session (``zerofix.check.session``) or by ``torch.distributed.run -m``; each writes
``rank{r}.json``. What every rank does around its run is ``zerofix.check.rank``."""
