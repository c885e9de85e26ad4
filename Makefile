# Every target bootstraps .venv on a fresh machine; nothing is needed beforehand but python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo demo-ray test test-slow bench bench-quick bench-storage bench-inference bench-ray clean-shm clean

# One stamp per set of extras, refreshed when pyproject.toml changes. The tests also get rsl_rl's own code, the
# reference for 002's GAE (tests/_rsl_rl.py), with --no-deps: its torch pin would pull a CUDA build of GBs.
# PYTHONWARNINGS drops only setuptools' "Editable installation ... folders with the same name as your package" notice,
# which is informational (this checkout is meant to be what `import shmbuf` finds); other warnings and errors still
# print, and a failed install still fails the make.
$(VENV)/.stamp-%: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install --quiet -e ".[$*]"
	$(if $(filter test,$*),$(PIP) install --quiet --no-deps rsl-rl-lib==5.5.1)
	@touch $@

demo: $(VENV)/.stamp-demo
	$(PY) -m shmbuf demo

# CartPole over a two-node Ray cluster started on this machine (a head node and one more) for 15 s, then per-node rates.
demo-ray: $(VENV)/.stamp-ray
	$(PY) examples/ray_cartpole.py --seconds 15

test: $(VENV)/.stamp-test
	$(PY) -m pytest -q -m "not slow"

test-slow: $(VENV)/.stamp-test
	$(PY) -m pytest -q -m slow

bench: $(VENV)/.stamp-bench
	$(PY) -m shmbuf bench

bench-quick: $(VENV)/.stamp-bench
	$(PY) -m shmbuf bench --quick

# Replay buffer (against TorchRL and a numpy ring, 1/2/4 inserting processes) and GAE: a few minutes.
bench-storage: $(VENV)/.stamp-bench
	$(PY) -m benchmarks.storage

# Batched inference (CartPole, shmbuf's AsyncBatchedCollector and Collector against TorchRL's AsyncBatchedCollector and
# MultiSyncCollector, 4/8/16 envs, two MLPs): about 10 minutes. The demo stamp brings gymnasium, which `bench` lacks.
bench-inference: $(VENV)/.stamp-bench
	$(PY) -m benchmarks.inference

# shmbuf on Ray (workers.RayCollector, one and two local nodes) against plain Ray actors and shmbuf alone: small, atari,
# CartPole; about 12 minutes (--quick: under 1). Results in benchmarks/results/<date>-<host>-ray.*
bench-ray: $(VENV)/.stamp-bench
	$(PY) -m benchmarks.on_ray

clean-shm: $(VENV)/.stamp-demo
	$(PY) -m shmbuf clean

clean:
	rm -rf $(VENV) build *.egg-info
