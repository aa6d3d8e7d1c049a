# Thin wrapper: every target first makes sure the packages are there and the
# build is current. The real build is CMake (CMakeLists.txt).
BUILD ?= build
KSCORE := $(BUILD)/cli/kscore
JOBS ?= $(shell nproc)

.PHONY: all bootstrap build run test test-cluster test-cluster-long soak chaos down clean asan profile fuzz deb install fleet-demo

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

# Every suite once, three at a time (each starts its own servers on free
# ports in its own temporary directories, and most of a suite's time is
# waiting for what it started), with no retry: a suite that fails is a
# race to find (make soak), never to run again.
TEST_JOBS ?= 3
test: build
	@cd $(BUILD) && ctest --output-on-failure -j$(TEST_JOBS)

# The cluster stack's suite (kscore up --cluster 3) alone, its two halves
# side by side (test_cluster, test_cluster_2; tests/CMakeLists.txt). It is
# in `make test` again: the losses of deliveries behind its flake (issue
# 22) are found and fixed (docs/cluster.md "When a leader moves").
test-cluster: build
	@cd $(BUILD) && ctest --output-on-failure -j2 -L cluster

# The cluster suite's long variants (KSCORE_CLUSTER_LONG=1: each fleet case
# of shared/cases/fleet-cases.md at the case's size; docs/cluster.md "When a leader
# moves"), then F05 (deliveries after the KSCORE_CMDS leader dies) 20 times
# in a row, with pass counts (tests/soak.sh). About 30 minutes.
test-cluster-long: build
	@KSCORE_CLUSTER_LONG=1 ./tests/soak.sh $(BUILD) 1 test_cluster
	@CK_RUN_CASE=deliveries_after_the_cmds_leader_dies \
	    ./tests/soak.sh $(BUILD) 20 test_cluster

# The timing-sensitive suites N times each (tests/soak.sh), with pass
# counts: `make soak N=10`, or SUITES="test_batch test_agent" for others.
# The suites' loops run side by side, as ctest runs them (test_cluster as
# its two halves); SOAK_SERIAL=1 runs one suite after another. About 60
# minutes for N=10 on 2 cores.
N ?= 10
SUITES ?= test_agent test_batch test_security test_cluster
soak: build
	@./tests/soak.sh $(BUILD) $(N) $(SUITES)

# A broker host and three agents in network namespaces, enrolled by bundle,
# over TCP + mutual TLS; one revoked (deploy/fleet-demo.sh; needs root).
fleet-demo: build
	@KSCORE=$(CURDIR)/$(KSCORE) ./deploy/fleet-demo.sh

# The fault-injection suite (tests/chaos/README.md): every scenario at full
# size, or CHAOS_SCALE=short (about 6-8 minutes, for CI, the three cluster
# scenarios about 1.5 of them); SCENARIO=a,b runs
# only those, SEED=N replays the random choices of an earlier run. Not part
# of `make test`. Exits non-zero when an invariant broke.
CHAOS_SCALE ?= full
chaos: build
	@$(BUILD)/tests/chaos/chaos $(if $(filter short,$(CHAOS_SCALE)),--short) \
	    $(if $(SCENARIO),--scenario $(SCENARIO)) $(if $(SEED),--seed $(SEED)) \
	    $(CHAOS_ARGS)

# The executor suite under ASan + UBSan.
asan: bootstrap
	@cmake -S . -B $(BUILD)-asan -DKSCORE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
	@cmake --build $(BUILD)-asan -j$(JOBS) --target test_exec
	@cd $(BUILD)-asan && ctest --output-on-failure -R test_exec

# The libFuzzer targets in tests/fuzz (clang, ASan + UBSan), FUZZ_SECONDS
# each, one after the other. New inputs go to $(BUILD)-fuzz/corpus/<target>
# (the seeds in tests/fuzz/corpus are read, never written); the first
# crash, leak, UB or timeout fails the target with its input in
# $(BUILD)-fuzz/artifacts/<target>/, the log in $(BUILD)-fuzz/fuzz_<target>.log.
# The targets link Debian's libprotobuf-c as it is (not instrumented), so
# coverage guides the fuzzer through kscore's own decoding and checks.
FUZZ_SECONDS ?= 30
FUZZ_TARGETS := unpack decode_command signed_command decide_report check_request
fuzz:
	@KSCORE_FUZZ=1 ./deploy/bootstrap.sh
	@CC=clang cmake -S . -B $(BUILD)-fuzz -DCMAKE_C_COMPILER=clang \
	    -DKSCORE_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(BUILD)-fuzz -j$(JOBS) --target fuzzers
	@[ -n "$(FUZZ_TARGETS)" ] || { echo "fuzz: no targets" >&2; exit 1; }
	@for t in $(FUZZ_TARGETS); do \
	    c=$(BUILD)-fuzz/corpus/$$t a=$(BUILD)-fuzz/artifacts/$$t; \
	    log=$(BUILD)-fuzz/fuzz_$$t.log; \
	    mkdir -p $$c $$a; \
	    echo "fuzz_$$t: $(FUZZ_SECONDS) s"; \
	    if ! $(BUILD)-fuzz/tests/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) \
	        -timeout=10 -print_final_stats=1 -artifact_prefix=$$a/ \
	        $$c tests/fuzz/corpus/$$t >$$log 2>&1; then \
	        tail -n 60 $$log; \
	        echo "fuzz_$$t: FAILED; input in $$a/, log $$log" >&2; exit 1; \
	    fi; \
	    grep -h '^Done' $$log; \
	    sed -n 's/^stat::average_exec_per_sec: */  exec\/s: /p' $$log; \
	done

# The SLO scenarios under perf record and heaptrack (perf/profile.sh).
profile: build
	@BUILD=$(BUILD) ./perf/profile.sh

down:
	@$(KSCORE) down

# Installs under PREFIX (default /usr/local; the units name
# PREFIX/etc/kscore, or /etc/kscore for PREFIX=/usr).
PREFIX ?= /usr/local
install: bootstrap
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=$(PREFIX) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS) --target kscore man
	@cmake --install $(BUILD)

# The Debian package (CPack DEB) in $(BUILD)-deb/: prefix /usr, units in
# /lib/systemd/system, configs in /etc/kscore. Only kscore and its daemon half
# (kscore-daemon, built with it) are built.
deb: bootstrap
	@cmake -S . -B $(BUILD)-deb -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	    -DCMAKE_INSTALL_PREFIX=/usr -DKSCORE_SYSTEMD_UNITDIR=/lib/systemd/system >/dev/null
	@cmake --build $(BUILD)-deb -j$(JOBS) --target kscore man
	@cd $(BUILD)-deb && cpack -G DEB >/dev/null && ls -1 $$PWD/kscore_*.deb

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-fuzz $(BUILD)-deb
