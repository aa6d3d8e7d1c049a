# Thin wrapper: every target first makes sure the packages are there and the
# build is current. The real build is CMake (CMakeLists.txt).
BUILD ?= build
KSCORE := $(BUILD)/cli/kscore
JOBS ?= $(shell nproc)

.PHONY: all bootstrap build run test down clean asan profile

all: build

bootstrap:
	@./deploy/bootstrap.sh

build: bootstrap
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)

# Start the local stack and run a real command on the local agent.
run: build
	@$(KSCORE) up
	@echo '$$ kscore exec -- sh -c "echo hello from \$$(hostname); uname -sr"'
	@$(KSCORE) exec --json -- sh -c 'echo hello from $$(hostname); uname -sr' > $(BUILD)/last-run.json; \
	 id=$$(sed -n 's/.*"command_id":"\([^"]*\)".*/\1/p' $(BUILD)/last-run.json); \
	 $(KSCORE) get $$id && echo && echo "$$ kscore events $$id" && $(KSCORE) events $$id

test: build
	@cd $(BUILD) && ctest --output-on-failure -j1

# The executor suite under ASan + UBSan.
asan: bootstrap
	@cmake -S . -B $(BUILD)-asan -DKSCORE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
	@cmake --build $(BUILD)-asan -j$(JOBS) --target test_exec
	@cd $(BUILD)-asan && ctest --output-on-failure -R test_exec

# The SLO scenarios under perf record and heaptrack (perf/profile.sh).
profile: build
	@BUILD=$(BUILD) ./perf/profile.sh

down:
	@$(KSCORE) down

clean:
	rm -rf $(BUILD) $(BUILD)-asan
