# The README's two commands: `make demo` (the main job) and `make test`. Both set up .venv first.
.PHONY: setup demo test

DEMO ?= demo
SCALE ?= tiny

setup:
	@bash tools/setup.sh

demo: setup
	.venv/bin/omniscale data demo $(DEMO) --scale $(SCALE)
	.venv/bin/omniscale data index $(DEMO)/mix.yaml $(DEMO)/eval.yaml
	.venv/bin/omniscale data inspect $(DEMO)/mix.yaml --plot $(DEMO)/mix.png

test: setup
	.venv/bin/python -m pytest -q
