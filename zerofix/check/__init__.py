"""The parity machinery: tiny real training scenarios run under torchrun and compared with a
reference update computed by hand in one process. Used by the tests and ``zerofix check``."""
