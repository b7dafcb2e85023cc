"""Scripts run on every rank by ``torch.distributed.run -m``; each writes ``rank{r}.json``."""
