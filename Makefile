# The two commands of the README:  make demo  and  make test.  Everything else is a step.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch build this project is tested with; override for another CUDA, e.g.
#   make install TORCH="torch==2.14.1 torchvision==0.29.1 --index-url https://download.pytorch.org/whl/cu128"
TORCH ?= torch==2.14.1 torchvision==0.29.1
SHARED_DATA ?= ../shared/data
SWEEP ?= demo/sweep

.PHONY: install data test demo bench clean
.DEFAULT_GOAL := demo

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev,slurm]"
	touch $@

# Fashion-MNIST: copied from a local copy when there is one; otherwise the first run
# downloads it (data.download=true).
data:
	@if [ ! -e data/FashionMNIST/raw/train-images-idx3-ubyte.gz ] && [ -d $(SHARED_DATA)/FashionMNIST/raw ]; then \
		mkdir -p data/FashionMNIST/raw && cp $(SHARED_DATA)/FashionMNIST/raw/*.gz data/FashionMNIST/raw/ && \
		chmod u+w data/FashionMNIST/raw/* && echo "Fashion-MNIST copied from $(SHARED_DATA)"; fi

test: install data
	$(VENV)/bin/pytest -q

# A small real scaling study on Fashion-MNIST (num_gpus x lr, 4 runs), then its report.
demo: install data
	rm -rf $(SWEEP)
	$(PY) train.py -m distributed.num_gpus=1,2 optim.lr=0.02,0.05 data.batch_size=64 \
		data.train_size=6000 data.val_size=2000 train.epochs=2 hydra.sweep.dir=$(SWEEP)
	$(PY) -m multirun_analysis $(SWEEP)

bench: install data
	$(PY) benchmarks/bench_training.py
	$(PY) benchmarks/step_jitter.py
	$(PY) benchmarks/step_phases.py
	$(PY) benchmarks/bench_allreduce.py
	$(PY) benchmarks/bench_analysis.py

clean:
	rm -rf outputs multirun demo .pytest_cache
