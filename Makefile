# One virtual environment per stack, pinned by constraints/<stack>.txt, inside the checkout (git-ignored).
STACK ?= latest
DEMO_STACK ?= 2026-04
PYTHON ?= python3
PYTEST_ARGS ?=

venv = .venvs/$(1)/.installed

.PHONY: demo test venv clean bench bench-ds
.PRECIOUS: .venvs/%/.installed

.venvs/%/.installed: constraints/%.txt setup.cfg setup.py
	@echo "== building .venvs/$* from constraints/$*.txt"
	$(PYTHON) -m venv .venvs/$*
	# torch first, pinned (an unpinned torch would pull a multi-GB CUDA build)
	.venvs/$*/bin/pip install -q -c constraints/$*.txt torch==2.13.0 setuptools wheel
	.venvs/$*/bin/pip install -q --no-build-isolation -c constraints/$*.txt -e '.[deepspeed,hf,dev]'
	touch $@

venv: $(call venv,$(STACK))

## The main job: what zerofix does on the pinned stack, then the fix shown on real training runs.
demo: $(call venv,$(DEMO_STACK))
	.venvs/$(DEMO_STACK)/bin/zerofix status --apply
	.venvs/$(DEMO_STACK)/bin/python -m zerofix.check.demo

## The test suite on one stack (stack-specific regression tests select themselves).
test: $(call venv,$(STACK))
	.venvs/$(STACK)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(call venv,$(STACK))
	.venvs/$(STACK)/bin/python benchmarks/bench_overhead.py

bench-ds: $(call venv,$(STACK))
	OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$(CURDIR)/.venvs/$(STACK)/.torch_extensions \
		.venvs/$(STACK)/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \
		benchmarks/bench_deepspeed_accumulation.py

clean:
	rm -rf .venvs build *.egg-info
