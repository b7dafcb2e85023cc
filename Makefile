# One virtual environment per stack, pinned by constraints/<stack>.txt, inside the checkout (git-ignored).
STACK ?= latest
CHECK_STACK ?= 2026-04
PYTHON ?= python3
PYTEST_ARGS ?=

venv = .venvs/$(1)/.installed
comma := ,
# matplotlib (zerofix check --plot) and accelerate's own tests' needs only on the stacks that run them; Triton (the fused
# kernel under its interpreter) on latest
extras = deepspeed,hf,dev$(if $(filter latest 2026-04,$(1)),$(comma)plot$(comma)upstream)$(if $(filter latest,$(1)),$(comma)peft$(comma)kernels)$(if $(filter latest 2026-04 trl160 trl1100 trl1142,$(1)),$(comma)grpo)$(if $(filter swift,$(1)),$(comma)swift)$(if $(filter llamafactory,$(1)),$(comma)llamafactory)$(if $(filter axolotl,$(1)),$(comma)axolotl)
# A stack's overrides (a dependency's pin replaced: LLaMA-Factory's torchaudio pins its own torch) and excludes (a
# package left out of the resolution), where its constraints/<stack>.overrides / .excludes exist
resolution = $(if $(wildcard constraints/$(1).overrides),--overrides constraints/$(1).overrides) \
	$(if $(wildcard constraints/$(1).excludes),--excludes constraints/$(1).excludes)

# The fast tier: unit, contract and structure tests plus one small distributed smoke per mechanism (tests
# marked smoke); the full tier adds every distributed matrix (marked distributed) and the slow rest (slow).
FAST_TIER = -m "not (distributed or slow) or smoke"
REST_OF_FULL_TIER = -m "(distributed or slow) and not smoke"

.PHONY: check test test-all test-rest tools venv warm clean bench bench-ds
.PRECIOUS: .venvs/%/.installed $(UV) $(TORCH_WHEELS)/.fetched

# uv installs (about 25 s a stack where pip took about 55: parallel, its cache shared by every stack's build), in a
# tools environment of its own. torch comes from the machine's CPU build, fetched once by pip (which knows where it
# lies): an unpinned torch, or one from the registry, would be a multi-GB CUDA build.
# Bytecode is written by the first import of each module, not at install: compiling a stack's 13,000 files took 60 -
# 90 s of both cores where a session's imports compile about 3,000 (20 CPU s). A machine that sets
# PYTHONDONTWRITEBYTECODE (this one does) would then compile torch again in every rank of every run: not for
# make's commands.
unexport PYTHONDONTWRITEBYTECODE
# DeepSpeed's CPU communication op (zerofix.check.host.prebuild) is compiled through ccache where it is installed
# (torch's extension builder prepends it by itself): seven stacks pin DeepSpeed 0.19.8, whose op then compiles
# once. Paths under the checkout are hashed relative to the build folder (.venvs/<stack>/.torch_extensions/...),
# the same in every stack.
export CCACHE_DIR ?= $(CURDIR)/.venvs/.ccache
export CCACHE_BASEDIR ?= $(CURDIR)
# pip inside a stack's environment only where a test runs it (accelerate's sdist, a wheel of zerofix) or a framework
# may: `python -m venv` seeds it for 10 s a stack
without_pip = $(if $(filter 2025-12 2025-10 2025-01 2024-11 trl151-ds0154 trl160 trl1100 trl1142,$(1)),--without-pip)
UV_VERSION = 0.13.9
# a command the editable install runs under (CI: `flock FILE`, so that builds side by side take turns there)
BUILD_LOCK ?=
UV = .venvs/.tools/bin/uv
TORCH_WHEELS = .venvs/.wheels

$(UV):
	$(PYTHON) -m venv .venvs/.tools
	.venvs/.tools/bin/pip install -q uv==$(UV_VERSION)

$(TORCH_WHEELS)/.fetched:
	$(PYTHON) -m pip download -q --no-deps torch==2.13.0 -d $(TORCH_WHEELS)
	@ls $(TORCH_WHEELS)/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 || { echo "pip found no CPU build of torch 2.13.0" \
		"(found: $$(ls $(TORCH_WHEELS))); the stacks need torch 2.13.0+cpu: put its wheel where pip finds it"; exit 1; }
	touch $@

.venvs/%/.installed: constraints/%.txt setup.cfg setup.py | $(UV) $(TORCH_WHEELS)/.fetched
	@echo "== building .venvs/$* from constraints/$*.txt"
	$(PYTHON) -m venv $(call without_pip,$*) .venvs/$*
	# torch first, the CPU build (pinned by the constraints too)
	$(UV) pip install -q --python .venvs/$*/bin/python -c constraints/$*.txt \
		$(TORCH_WHEELS)/torch-2.13.0+cpu-*.whl setuptools wheel
	# compat: the checkout on sys.path, so a folder named zerofix beside a script cannot shadow the package. The one
	# step that writes in the checkout (zerofix.egg-info): builds side by side (CI) take turns here, through BUILD_LOCK
	$(BUILD_LOCK) $(UV) pip install -q --python .venvs/$*/bin/python --no-build-isolation -c constraints/$*.txt \
		$(call resolution,$*) -e '.[$(call extras,$*)]' --config-settings editable_mode=compat
	# torchaudio's wheels on the registry are CUDA builds (none for torch 2.13): its native libraries cannot load
	# beside the CPU torch, and without them its Python part imports (LLaMA-Factory imports it at start-up)
	rm -f .venvs/$*/lib/python*/site-packages/torchaudio/lib/*.so
	# torchvision's wheel (the llamafactory stack's vision-language rows: Qwen2-VL's processor) is a CUDA build too: its
	# operators cannot load beside the CPU torch, and its Python part imports once its two unconditional fake-kernel
	# registrations (torchvision::nms, ::qnms, whose operators only its native library defines) are guarded
	for f in .venvs/$*/lib/python*/site-packages/torchvision/_meta_registrations.py; do [ ! -f "$$f" ] || sed -i \
		's/^@torch.library.register_fake("torchvision::\(q\?nms\)")$$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' "$$f"; done
	touch $@

## The tools every stack's build shares (uv, torch's CPU wheel): built first where builds run side by side
tools: $(UV) $(TORCH_WHEELS)/.fetched

venv: $(call venv,$(STACK))

## The environment and DeepSpeed's CPU op (JIT-built by a stack's first run otherwise: about 30 s of both cores).
warm: $(call venv,$(STACK))
	.venvs/$(STACK)/bin/python -m zerofix.check.host.prebuild

## The main job: `zerofix check` on the pinned stack (every scenario unpatched and patched against the
## single-process reference). Exit 1 means a scenario is WRONG or failed; the table says which and why.
check: $(call venv,$(CHECK_STACK))
	@status=0; .venvs/$(CHECK_STACK)/bin/zerofix check $(CHECK_ARGS) || status=$$?; \
	if [ $$status -ne 0 ]; then echo "zerofix check exited with $$status: see the verdicts above"; fi; exit $$status

## The fast tier, after every change (under 3 minutes on 2 cores; stack-specific tests select themselves).
test: $(call venv,$(STACK))
	.venvs/$(STACK)/bin/python -m pytest -q -p no:cacheprovider $(FAST_TIER) $(PYTEST_ARGS)

## The full tier on one stack: every test, every distributed matrix.
test-all: $(call venv,$(STACK))
	.venvs/$(STACK)/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

## What test-all runs that test does not (CI runs test, then this, on the first stack).
test-rest: $(call venv,$(STACK))
	.venvs/$(STACK)/bin/python -m pytest -q -p no:cacheprovider $(REST_OF_FULL_TIER) $(PYTEST_ARGS)

bench: $(call venv,$(STACK))
	.venvs/$(STACK)/bin/python benchmarks/bench_overhead.py

bench-ds: $(call venv,$(STACK))
	OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=$(CURDIR)/.venvs/$(STACK)/.torch_extensions \
		.venvs/$(STACK)/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \
		benchmarks/bench_deepspeed_accumulation.py

clean:
	rm -rf .venvs build *.egg-info
