# amp-course: `make lab` to study, `make test` to check everything. Both set themselves up.
# Only python3 (>= 3.10) and make are needed; the virtual environment lives in .venv/.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# pytest arguments shared by the CPU and the GPU tier: library tests + every teaching, exercise and
# solution notebook executed by nbval cell by cell, as Run All would (stored outputs are compared
# only in nbval-check-output cells, after tests/nbval_sanitize.cfg; conftest.py hides CUDA in the
# CPU tier). The solutions' inline checks stay silent there: the batch grader judges every
# solution's tasks, once, in tests/test_grader.py. Every run ends with its 20 slowest tests.
NBVAL  := --nbval-lax --nbval-current-env --nbval-cell-timeout=600 --nbval-sanitize-with tests/nbval_sanitize.cfg
SUITE  := tests notebooks exercises solutions
DURATIONS := --durations=20
# Two test processes (pytest-xdist), each taking whole files, so that a notebook's cells run in
# order in one kernel and a module's fixtures are made once: while one waits (a kernel starting, a
# process group meeting, a grader's time limit), the other works. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
WORKERS := -n $(TEST_WORKERS) --dist loadfile
LAB_ARGS ?=
# Jupyter refuses to run as root unless told; containers and CI machines often are root.
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: help venv lab update test test-fast test-chapter test-under-load test-gpu test-floor bench site exercises stamp grade clean

help:
	@echo "make help             this list"
	@echo "make lab              open JupyterLab on the course (creates .venv on first use)"
	@echo "make venv             only set up .venv (make lab and make test do it themselves)"
	@echo "make update           git pull the course's newest version, keeping your outputs and answers"
	@echo "make test             run every test: library, notebooks (nbval), grading, exercises in sync"
	@echo "make test-fast        library and chapter-module tests: no notebooks, no batch grading (a few minutes)"
	@echo "make test-chapter N=07  one chapter: its notebooks, its tests, its solution and exercise through the grader"
	@echo "make test-under-load  the tests whose verdict reads a clock, with every core kept busy (tools/under_load.py)"
	@echo "make test-gpu         the same suite as make test with the current python3 and the GPU cells forced on"
	@echo "make test-floor       library tests and chapters on the LOWEST torch/torchvision pyproject.toml allows (.venv-floor)"
	@echo "make bench            FP32 / TF32 / AMP table for this machine (python -m course_lib.chapters.ch00.bench)"
	@echo "make site             the published edition: the course as a book with its outputs, read offline (build/site/)"
	@echo "make exercises        regenerate exercises/ from solutions/"
	@echo "make stamp            write the Colab badge and setup cell (from pyproject.toml) into every notebook"
	@echo "make grade SUBMISSIONS=dir [GRADEBOOK=dir] [JOBS=n]   grade a folder of submissions (resumes)"
	@echo "make clean            remove .venv, .venv-floor, build/ (executed copies, the edition), runs/, gradebook/"

# The install is redone only when pyproject.toml changes. torch and torchvision are floors:
# pip picks a pair that imports (a fresh venv gets the newest matching pair).
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e ".[lab,test,site]"
	@$(VPY) -c "import torch; print('installed torch', torch.__version__)"
	@# torchvision is needed only for the ResNet models; a mismatched pair must not stop the course.
	@$(VPY) -c "import torchvision; print('installed torchvision', torchvision.__version__)" 2>/dev/null || \
	  echo "warning: torchvision does not import next to this torch; only the ResNet cells need it (pip install -U torch torchvision)"
	@touch $(STAMP)

# JupyterLab's defaults for the course (overrides.json in the venv; a learner's own settings win).
# It works offline: no news, no update checks. It saves widget state with the notebook, so a
# reopened chapter shows each progress bar as it ended instead of "Error displaying widget".
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json
$(LAB_SETTINGS): $(STAMP) Makefile
	@mkdir -p $(dir $@)
	@echo '{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false},' \
	  '"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": true}}' > $@

venv: $(STAMP) $(LAB_SETTINGS)

# Rooted at the repository, so the file browser and the chapters' links reach exercises/,
# solutions/, course_lib/ and data/; it opens on chapter 00 with the file browser at the top
# (file-browser-path; passing the notebook as an argument instead would root JupyterLab at
# notebooks/). course_lib/tooling/lab.py runs JupyterLab printing that URL with its token joined by
# `&` (jupyter lab prints `...?file-browser-path=/?token=...`, which opens the login page), and its
# contents manager keeps a notebook that was only read byte for byte unchanged. Before starting, git
# is told to read the notebooks without their outputs (course_lib/tooling/notebook_filter.py; nothing
# happens outside a git checkout), so running a chapter leaves `git status` clean and `git pull` free.
lab: $(STAMP) $(LAB_SETTINGS)
	@$(VPY) course_lib/tooling/notebook_filter.py install "$(CURDIR)"
	$(VPY) -m course_lib.tooling.lab $(LAB_ROOT) --ServerApp.root_dir="$(CURDIR)" \
	  --ServerApp.contents_manager_class=course_lib.tooling.lab.CourseContentsManager \
	  "--LabApp.default_url=/lab/tree/notebooks/00_setup.ipynb?file-browser-path=/" \
	  --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate $(LAB_ARGS)

# The course's newest version, keeping the learner's work: outputs of chapters the update does
# not change, and answers in exercises/ (git refuses, and says so, where an update would replace
# an answered exercise: README, "Updating the course"). Needs no venv.
update:
	@$(PYTHON) course_lib/tooling/notebook_filter.py update "$(CURDIR)"

test: $(STAMP)
	$(VPY) -m course_lib.device
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check course_lib tests tools conftest.py
	$(VPY) -m pytest $(SUITE) $(NBVAL) $(WORKERS) $(DURATIONS)

# A contributor's way in: the library and chapter-module tests, without the notebooks, the batch
# grader and the other tests marked slow (pyproject.toml's markers).
test-fast: $(STAMP)
	$(VPY) -m pytest tests -m "not slow" $(WORKERS) $(DURATIONS)

# One chapter (N=07): its notebook, exercise and solution (nbval), the tests of its modules and
# checks (found by tools/chapter_tests.py), its solution and exercise through the batch grader.
N ?=
test-chapter: $(STAMP)
	@test -n "$(N)" || { echo "usage: make test-chapter N=07"; exit 2; }
	$(VPY) -m pytest $$($(VPY) tools/chapter_tests.py $(N)) $(NBVAL) --chapter $(N) $(WORKERS) $(DURATIONS)

# The tests marked `timing` (their verdict reads a clock), with a busy process on every core:
# each must pass on a loaded machine, as CI's and a learner's often are.
test-under-load: $(STAMP)
	$(VPY) tools/under_load.py

# GPU tier (docs/gpu.md): no venv, no network; cells tagged `gpu` must run.
test-gpu:
	python3 -m course_lib.device
	COURSE_GPU_TIER=1 python3 -m pytest $(SUITE) $(NBVAL) $(DURATIONS) -p no:cacheprovider

# The declared floor, tested: a second venv with exactly the lowest torch and torchvision that
# pyproject.toml allows (read from it by tools/floor_constraints.py, so raising a floor moves
# this target), pinned by a constraints file so that nothing pip resolves can upgrade them.
# PyPI's Linux torch is the CUDA build: its nvidia-* packages are installed too, because torch
# 2.6 does not import without them (libcudart.so.12), even on a machine with no GPU.
FLOOR_VENV  := .venv-floor
FLOOR_VPY   := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed-stamp
FLOOR_SUITE ?= tests notebooks

$(FLOOR_STAMP): pyproject.toml tools/floor_constraints.py
	@test -x $(FLOOR_VPY) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(PYTHON) tools/floor_constraints.py pyproject.toml > $(FLOOR_VENV)/floor-constraints.txt
	$(FLOOR_VPY) -m pip install -q --upgrade pip
	$(FLOOR_VPY) -m pip install -q -c $(FLOOR_VENV)/floor-constraints.txt -e ".[lab,test,site]"
	@$(FLOOR_VPY) -c "import torch, torchvision; print('floor: torch', torch.__version__, 'torchvision', torchvision.__version__)"
	@touch $(FLOOR_STAMP)

# Same flags as `make test`; conftest.py hides CUDA. -p no:cacheprovider keeps this run's
# failures out of .pytest_cache, which belongs to .venv's runs (pytest --lf).
test-floor: $(FLOOR_STAMP)
	$(FLOOR_VPY) -m course_lib.device
	$(FLOOR_VPY) -m pytest $(FLOOR_SUITE) $(NBVAL) $(WORKERS) $(DURATIONS) -p no:cacheprovider

bench: $(STAMP)
	$(VPY) -m course_lib.chapters.ch00.bench

# The published edition (README, "Reading without running"): build/site/index.html, a book read offline
# (Sphinx, course_lib/tooling/site_template/). It reuses the outputs `make test` saved in build/executed/
# and executes only the chapters that run has not (SITE_ARGS=--reuse-only refuses to: CI checks that
# nothing runs twice); exercises are published as the course ships them, never with a learner's answers.
# Then the check: every link, anchor and image, nothing from the network, no data dump, no path of this
# machine, no answered exercise.
SITE_ARGS ?=
site: $(STAMP)
	$(VPY) -m course_lib.tooling.site build $(SITE_ARGS)
	$(VPY) -m course_lib.tooling.site check

exercises: $(STAMP)
	$(VPY) -m course_lib.tooling.exercises

stamp: $(STAMP)
	$(VPY) -m course_lib.tooling.colab stamp

SUBMISSIONS ?= submissions
GRADEBOOK   ?= gradebook
JOBS        ?= 2
# Each submission runs sandboxed; the gradebook grows task by task and a rerun resumes.
grade: $(STAMP)
	$(VPY) -m course_lib.tooling.grader $(SUBMISSIONS) --out $(GRADEBOOK) --jobs $(JOBS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache runs gradebook build
