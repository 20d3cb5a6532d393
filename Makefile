# The README's two commands: `make demo` (the main job) and `make test`. Both set up .venv first.
.PHONY: setup demo test

DEMO ?= demo
SCALE ?= tiny
RUN ?= runs/demo_omni
NPROC ?= 2
TRAIN_SET ?=  # extra `--set key=value` overrides, e.g. TRAIN_SET="--set steps=20"
CALIBRATE ?= --repeats 3  # `omniscale balance calibrate` flags for the demo's cost file

setup:
	@bash tools/setup.sh

# Demo data (generated and indexed once), its mixture report, the balancer's cost model timed on
# this machine (once: delete $(DEMO)/costs.json to re-measure), then a fresh training run of the
# omni MoE on NPROC CPU processes with the embedded data plane planning in those seconds,
# held-out evaluation and report.
demo: setup
	.venv/bin/omniscale data demo $(DEMO) --scale $(SCALE)
	.venv/bin/omniscale data index $(DEMO)/mix.yaml $(DEMO)/eval.yaml
	.venv/bin/omniscale data inspect $(DEMO)/mix.yaml --plot $(DEMO)/mix.png
	test -f $(DEMO)/costs.json || .venv/bin/omniscale balance calibrate configs/demo_omni.yaml \
	    --set data.spec=$(DEMO)/mix.yaml --set eval.enabled=false --nproc $(NPROC) \
	    --out $(DEMO)/costs.json $(CALIBRATE)
	rm -rf $(RUN)
	.venv/bin/omniscale train configs/demo_omni.yaml --nproc $(NPROC) \
	    --set data.spec=$(DEMO)/mix.yaml --set data.eval_spec=$(DEMO)/eval.yaml \
	    --set data.demo_scale=$(SCALE) --set data.costs=$(DEMO)/costs.json \
	    --set output_dir=$(RUN) $(TRAIN_SET)
	.venv/bin/omniscale report $(RUN)

# Two xdist workers: much of the suite waits on the processes it starts (ranks, Ray, the
# plane), so two workers on CI's two cores finish in about four fifths of the serial time;
# the Ray tests keep to one worker (their `xdist_group`).
test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -n 2 --dist loadgroup
