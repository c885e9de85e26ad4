# Every target bootstraps .venv on a fresh machine; nothing is needed beforehand but python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo demo-ray test test-slow test-core lint bench-smoke bench bench-quick bench-zero-copy bench-storage bench-inference bench-collect bench-ray bench-multiagent bench-multiagent-loop bench-train clean-shm clean

# One stamp per set of extras, refreshed when pyproject.toml changes. The tests also get rsl_rl's own code, the
# reference that shmbuf's rsl_rl-style GAE must equal (tests/_rsl_rl.py), with --no-deps: its torch pin would pull
# a CUDA build of GBs.
# PYTHONWARNINGS drops only setuptools' "Editable installation ... folders with the same name as your package" notice,
# which is informational (this checkout is meant to be what `import shmbuf` finds); other warnings and errors still
# print, and a failed install still fails the make.
$(VENV)/.stamp-%: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(PIP) install --quiet -e ".[$*]"
	$(if $(filter test,$*),$(PIP) install --quiet --no-deps rsl-rl-lib==5.5.1)
	@touch $@

# `make lint` and `make test-core` each have a venv of their own, so that neither sees what `make test` installs:
# .venv-lint holds the core and the pinned linters (the `lint` extra), .venv-core the core and the test runner alone
# (the `core-test` extra), so that a module that imports an optional package where the core needs it fails there.
# The '*' .gitignore keeps them out of git, as Python 3.13's venv does by itself.
CORE_VENV := .venv-core
LINT_VENV := .venv-lint
# ruff checks all the Python of the checkout; mypy checks the packages (pyproject's [tool.mypy] files).
LINT_PATHS := shmbuf workers tests benchmarks examples .ci

define own_venv
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	@echo '*' > $(1)/.gitignore
	$(1)/bin/python -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(1)/bin/python -m pip install --quiet -e ".[$(2)]"
	@touch $@
endef

$(CORE_VENV)/.stamp: pyproject.toml
	$(call own_venv,$(CORE_VENV),core-test)

$(LINT_VENV)/.stamp: pyproject.toml
	$(call own_venv,$(LINT_VENV),lint)

demo: $(VENV)/.stamp-demo
	$(PY) -m shmbuf demo

# CartPole over a two-node Ray cluster started on this machine (a head node and one more) for 15 s, then per-node rates.
demo-ray: $(VENV)/.stamp-ray
	$(PY) examples/ray_cartpole.py --seconds 15

# The library's tests (tests/, but tests/bench: see bench-smoke), in TEST_WORKERS pytest-xdist worker processes: a few
# minutes on 2 cores (about 10 in one process, where most of a test's time is waiting). --dist loadgroup keeps each
# xdist group on one worker (tests/conftest.py hands the groups to xdist's scheduler): the Ray tests share one cluster
# there, and the tests marked `alone` run with no other beside them. --no-loadscope-reorder keeps the queue in the order
# conftest gives it: the Ray tests first (the longest chain), the `alone` ones last. TEST_WORKERS=0 runs them all in
# this process.
TEST_WORKERS ?= 4
test: $(VENV)/.stamp-test
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# ruff over the checkout, mypy over the packages, and a reason on every noqa and type: ignore (.ci/lint_reasons.py);
# all three run, and any failing fails the target.
lint: $(LINT_VENV)/.stamp
	@status=0; \
	$(LINT_VENV)/bin/ruff check $(LINT_PATHS) || status=1; \
	$(LINT_VENV)/bin/mypy || status=1; \
	$(LINT_VENV)/bin/python .ci/lint_reasons.py $(LINT_PATHS) || status=1; \
	exit $$status

# The core alone (no extras): every public module imports, each in a fresh interpreter, and the tests that need no
# extra pass (.ci/core_tests.py says how they are chosen; the rest run in `make test`), in workers as `make test` runs.
test-core: $(CORE_VENV)/.stamp
	$(CORE_VENV)/bin/python .ci/import_core.py
	$(CORE_VENV)/bin/python .ci/core_tests.py -q -m "not slow" -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test-slow: $(VENV)/.stamp-test
	$(PY) -m pytest -q -m slow

# The benchmarks' smoke tests (tests/bench): each benchmark CLI at its smallest, every system it compares (RLlib's
# MultiAgentEnvRunner, TorchRL, echo, faster-fifo, ...) with the bench extra's packages, and the report's arithmetic;
# about a minute and a half in 3 pytest-xdist workers (2 minutes in one process, where most of a smoke run's time is
# waiting for the processes it starts); the two that start Ray clusters share an xdist group, so one runs at a time.
bench-smoke: $(VENV)/.stamp-test $(VENV)/.stamp-bench
	$(PY) -m pytest -q -m "not slow" -n 3 --dist loadgroup --no-loadscope-reorder tests/bench

bench: $(VENV)/.stamp-bench
	$(PY) -m shmbuf bench

bench-quick: $(VENV)/.stamp-bench
	$(PY) -m shmbuf bench --quick

# Zero-copy batches when writers pause: the reader's books alone, simulated time, 20 settings (about 20 s).
bench-zero-copy: $(CORE_VENV)/.stamp
	$(CORE_VENV)/bin/python -m benchmarks.zero_copy

# Replay buffer (against TorchRL and a numpy ring, 1/2/4 inserting processes) and GAE: a few minutes.
bench-storage: $(VENV)/.stamp-bench
	$(PY) -m benchmarks.storage

# Batched inference (CartPole, shmbuf's AsyncBatchedCollector and Collector against TorchRL's AsyncBatchedCollector and
# MultiSyncCollector, 4/8/16 envs, two MLPs): about 10 minutes. The demo stamp brings gymnasium, which `bench` lacks.
bench-inference: $(VENV)/.stamp-bench
	$(PY) -m benchmarks.inference

# Multi-core collection from 16 envs (CartPole and an Atari-shaped env; a numpy linear policy, torch MLPs): the
# one-process loops (the floors), gymnasium's AsyncVectorEnv, PufferLib, TorchRL's MultiSyncCollector, Collector and
# AsyncBatchedCollector, each in its best configuration: about 13 minutes (--quick: about 1); then ActorLoop against the
# bare loop in one process (benchmarks/actor_loop.py, about 2 minutes). pufferlib-core is installed
# here with --no-deps: it pins torch==2.9.0, which would replace the CPU build of the pinned torch.
# Results in benchmarks/results/<date>-<host>-collect.*
bench-collect: $(VENV)/.stamp-bench
	$(PIP) install --quiet --no-deps pufferlib-core==3.0.23
	$(PY) -m benchmarks.collect
	$(PY) -m benchmarks.actor_loop

# shmbuf on Ray (workers.RayCollector, one and two local nodes) against plain Ray actors and shmbuf alone: small, atari,
# CartPole; about 12 minutes (--quick: under 1). Results in benchmarks/results/<date>-<host>-ray.*
bench-ray: $(VENV)/.stamp-bench
	$(PY) -m benchmarks.on_ray

# Multi-agent collection: agent steps/s delivered to the learner from 4 PettingZoo envs (MPE2's simple_spread
# with 8 agents, a synthetic env of 16), numpy linear policies: the one-process loop, workers.MultiAgentCollector and
# RLlib's MultiAgentEnvRunner (Ray 2.60, remote env runners and a local one), in one run: about 20 minutes (--quick:
# about 3; each RLlib run starts and stops Ray). RLlib's requirements come from the bench extra one by one: `ray[rllib]` would pin gymnasium==1.2.2.
# Results in benchmarks/results/<date>-<host>-multiagent.*
bench-multiagent: $(VENV)/.stamp-bench
	$(PY) -m benchmarks.multiagent

# workers.lowlevel.MultiAgentLoop against the one-process loop of bench-multiagent, in one process, CPU per agent step
# (synthetic and simple_spread envs): about a minute. Results in benchmarks/results/<date>-<host>-multiagent-loop.*
bench-multiagent-loop: $(VENV)/.stamp-bench
	$(PY) -m benchmarks.multiagent_loop

# Training at speed: CleanRL's PPO (examples/ppo_cleanrl.py) in one process against the same loop on workers.Collector at
# max_policy_lag 0 and 1 (CartPole-v1 and Acrobot-v1, 3 seeds, each run until its return threshold), then collection
# from real Atari (Pong, Breakout; 8 and 16 envs; random and CNN policies) by every system: one process, Collector,
# AsyncBatchedCollector, gymnasium's AsyncVectorEnv, PufferLib, EnvPool sync and async, ale-py's vector env. About
# 30 minutes on a quiet 2-core machine (PPO about 21, Atari about 9; it prints its estimate first; --quick: 1-2).
# pufferlib-core is installed with --no-deps as for bench-collect. Results in benchmarks/results/<date>-<host>-train.*
bench-train: $(VENV)/.stamp-bench
	$(PIP) install --quiet --no-deps pufferlib-core==3.0.23
	$(PY) -m benchmarks.train

clean-shm: $(VENV)/.stamp-demo
	$(PY) -m shmbuf clean

clean:
	rm -rf $(VENV) $(CORE_VENV) $(LINT_VENV) .mypy_cache .ruff_cache build *.egg-info
