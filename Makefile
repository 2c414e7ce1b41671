# The two commands of the README's quick start. Each sets everything up first (scripts/setup.sh: packages
# installed once, the extension built incrementally in build/), and `make wheel` builds the prebuilt wheel.
.PHONY: setup setup-test train test wheel

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh --test

# The main job: a small policy trained with GRPO on a verifiable task (see examples/train_policy.py).
train: setup
	.venv/bin/python examples/train_policy.py

# The tests compile with torch.compile into a cache of their own: inductor's shared cache (/tmp/torchinductor_$USER)
# may hold graphs compiled against an earlier build's op schemas, whose calls it replays with the old arguments.
test: setup-test
	TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor .venv/bin/python -m pytest tests -q

# A wheel with the CPU kernels and the CUDA kernels for sm_80, sm_90a and sm_100 (+PTX): scripts/build_wheel.sh.
wheel:
	bash scripts/build_wheel.sh
