# The README's two commands: `make demo` (the main job) and `make test`. Both set up .venv first.
.PHONY: setup demo test

DEMO ?= demo
SCALE ?= tiny
RUN ?= runs/demo_omni
NPROC ?= 2
TRAIN_SET ?=  # extra `--set key=value` overrides, e.g. TRAIN_SET="--set steps=20"

setup:
	@bash tools/setup.sh

# Demo data (generated and indexed once), its mixture report, then a fresh training run of the
# omni MoE on NPROC CPU processes with the embedded data plane, held-out evaluation and report.
demo: setup
	.venv/bin/omniscale data demo $(DEMO) --scale $(SCALE)
	.venv/bin/omniscale data index $(DEMO)/mix.yaml $(DEMO)/eval.yaml
	.venv/bin/omniscale data inspect $(DEMO)/mix.yaml --plot $(DEMO)/mix.png
	rm -rf $(RUN)
	.venv/bin/omniscale train configs/demo_omni.yaml --nproc $(NPROC) \
	    --set data.spec=$(DEMO)/mix.yaml --set data.eval_spec=$(DEMO)/eval.yaml \
	    --set data.demo_scale=$(SCALE) --set output_dir=$(RUN) $(TRAIN_SET)
	.venv/bin/omniscale report $(RUN)

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q
