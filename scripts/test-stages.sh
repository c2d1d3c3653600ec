#!/bin/sh
# `make test`'s stages, timed: lint, every test on debian-cloud, the examples on the buildroot-style
# images (a root filesystem qprobe reaches through its pre-init, whose rc scripts run beside the
# tests), then the VM core on each image of $STAGE_IMAGES. The kernels those stages need are fetched (and minimal-6.12 built) in the
# background while the first stage runs, at the lowest priority, so the build costs the VM tests
# little and the wait for it mostly disappears. Every stage runs even when one fails; at the end a
# table gives each stage's time and pytest's counts, and the exit status is the first failure's.
# A skip fails every pytest stage unless tests/image-lacks.toml lists the fact it names as one the
# image lacks (--qprobe-no-skip --qprobe-lacks): a skip is reviewed, never a quiet pass.
#
# The arm64 images then run their own tests, each a stage.
#
#   test-stages.sh BIN "VM_CORE FILES" "IMAGES" "ARM64 FILES" "ARM64 IMAGES"
set -u

bin=$1
core=$2
images=$3
arm64_files=${4:-}
arm64_images=${5:-}
logs=${TMPDIR:-/tmp}/qprobe-test-$$
mkdir -p "$logs"
table="$logs/stages"
: >"$table"
status=0
started=$(date +%s)

stage() { # NAME LOG COMMAND...: run, tee to LOG, note time and pytest's last line
	name=$1 log=$2
	shift 2
	t0=$(date +%s)
	"$@" 2>&1 | tee "$log"
	rc=$(cat "$log.rc" 2>/dev/null || echo 0)
	rm -f "$log.rc"
	summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
	printf '%s\t%s s\t%s\t%s\n' "$name" "$(($(date +%s) - t0))" "$rc" "${summary:--}" >>"$table"
	[ "$rc" -eq 0 ] || { [ $status -ne 0 ] || status=$rc; }
}

run() { # COMMAND... with its status kept beside the log (a pipeline loses it)
	log=$1
	shift
	"$@"
	echo $? >"$log.rc"
}

# Fetch and build in the background: each image under the cache's own lock, so the fetch before
# each stage below waits for that image alone (or finds it done) rather than building it again.
(for i in $images $arm64_images; do NICE=19 nice -n 19 "$bin/qprobe" images --fetch "$i" || exit 1; done) \
	>"$logs/fetch.log" 2>&1 &
fetcher=$!
strict="--qprobe-no-skip --qprobe-lacks tests/image-lacks.toml"

stage lint "$logs/lint.log" sh -c "
	$bin/ruff check qprobe tests examples scripts &&
	$bin/ruff format --check qprobe tests examples scripts &&
	$bin/mypy; echo \$? >$logs/lint.log.rc"
# shellcheck disable=SC2086 # the options are split on purpose
stage debian-cloud "$logs/debian-cloud.log" run "$logs/debian-cloud.log" \
	"$bin/pytest" -q -rs --durations=25 $strict tests examples
# shellcheck disable=SC2086 # the options are split on purpose
stage buildroot-examples "$logs/buildroot-examples.log" run "$logs/buildroot-examples.log" \
	"$bin/pytest" -q -rs $strict --qprobe-image buildroot-ext2 --qprobe-image buildroot-cpio examples
for i in $images; do
	"$bin/qprobe" images --fetch "$i" || { status=1; continue; }
	# shellcheck disable=SC2086 # the options and the list of files are split on purpose
	stage "$i" "$logs/$i.log" run "$logs/$i.log" "$bin/pytest" -q -rs --durations=25 $strict --qprobe-image "$i" $core
done

for i in $arm64_images; do
	"$bin/qprobe" images --fetch "$i" || { status=1; continue; }
	# shellcheck disable=SC2086 # the options and the list of files are split on purpose
	stage "$i" "$logs/$i.log" run "$logs/$i.log" "$bin/pytest" -q -rs --durations=25 $strict --qprobe-image "$i" $arm64_files
done

wait $fetcher || { echo "fetching in the background failed:"; cat "$logs/fetch.log"; }
echo
echo "make test: stages ($(($(date +%s) - started)) s in all; logs in $logs)"
printf 'stage\ttime\tstatus\tresult\n'
cat "$table"
exit $status
