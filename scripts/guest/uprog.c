/*
 * uprog: the guest program qprobe's user-space probe tests run.  Its
 * functions take known arguments and return known values, so what a probe
 * fetches can be compared with what the program passed:
 *
 *     long qpt_target(long a, long b, const char *s)   returns a + b
 *     long qpt_recurse(long depth)                     returns depth
 *     long qpt_lib_add(long a, long b)                 returns a + b (libqpt)
 *
 * Each mode ends with exactly one summary line of key=value pairs,
 *
 *     uprog mode=call build=dynamic n=3 pid=57 ret=12 calls=3 bad=0 a=10 b=0 s=hi
 *
 * where calls counts the probed function's calls the mode made, ret is the
 * last call's return value and bad counts returns that differed from the
 * expected value (a probe that changed one).  Lines of forked children and
 * of the image before an exec start with "uprog-child" and "uprog-exec".
 *
 * Built twice on the host (see qprobe/images/guest.py):
 *     gcc -static -O2 -g -Wall -pthread -DUPROG_STATIC -o uprog-static uprog.c libqpt.c
 *     gcc -O2 -g -Wall -pthread -o uprog uprog.c -L. -lqpt -Wl,-rpath,/usr/lib
 * Exit status: 0 when the mode ran and every return was as expected, 3 when
 * some were not (bad > 0), 1 when its setup failed, 2 on a usage error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef UPROG_STATIC
#define BUILD "static"
#else
#define BUILD "dynamic"
#endif

#define MAX_COUNT 100000000UL /* calls per mode */
#define MAX_DEPTH 10000UL     /* recursion: well inside an 8 MiB stack */
#define MAX_PROCS 64UL        /* children of fork, threads of threads */

long qpt_lib_add(long a, long b); /* libqpt.c */

static const char *mode_name;
static unsigned long bad;  /* returns that differed from the expected value */
static char extra[512];    /* mode specific key=value pairs */

/*
 * The probe target.  noipa: never inlined, cloned or specialised, so every
 * call passes a, b and s in %rdi, %rsi and %rdx and returns in %rax.  It
 * touches no global and calls nothing: remap runs it from a second mapping
 * of the file, where a %rip-relative reference would miss.
 */
__attribute__((noipa, used)) long qpt_target(long a, long b, const char *s)
{
	__asm__ volatile("" : : "r"(s));
	return a + b;
}

/* qpt_recurse(d) calls qpt_recurse(d - 1) and returns d: d + 1 calls in all. */
__attribute__((noipa, used)) long qpt_recurse(long depth)
{
	long r;

	if (depth <= 0)
		return 0;
	r = qpt_recurse(depth - 1);
	/* Keeps gcc from turning the recursion into a loop. */
	__asm__ volatile("" : "+r"(r));
	return r + 1;
}

static void usage(void)
{
	fputs("usage: uprog MODE ARGS...\n"
	      "  call N A B STR           qpt_target(A+i, B, STR) for i=0..N-1\n"
	      "  lib N [A B]              qpt_lib_add(A+i, B) for i=0..N-1 (A=0, B=1)\n"
	      "  recurse DEPTH            qpt_recurse(DEPTH): DEPTH+1 calls, level d returns d\n"
	      "  fork N M                 N children, child k calls qpt_target(i, k, \"fork\")\n"
	      "                           M times; the parent too, as k=0\n"
	      "  wait-then-call SECONDS N print the pid, sleep, then qpt_target(i, 0, \"wait\")\n"
	      "                           and qpt_lib_add(i, 0) N times each\n"
	      "  selfmod N                rewrite qpt_target's text page with its own bytes\n"
	      "                           (mprotect), then qpt_target(i, 0, \"selfmod\") N times\n"
	      "  remap N                  map the program again and call qpt_target(i, 0, \"remap\")\n"
	      "                           N times through that mapping, then unmap it\n"
	      "  exec N                   qpt_target(i, 0, \"pre-exec\") N times, then exec\n"
	      "                           itself as: call N 0 0 exec\n"
	      "  threads T N              T threads, thread k calls qpt_target(i, k, \"thread\") N times\n"
	      "  getppid N                call libc's getppid N times\n",
	      stderr);
	exit(2);
}

static unsigned long count(const char *s, const char *what, unsigned long max)
{
	char *end;
	unsigned long v;

	errno = 0;
	v = strtoul(s, &end, 0);
	if (errno || end == s || *end || s[0] == '-' || v > max) {
		fprintf(stderr, "uprog: %s must be a number from 0 to %lu, not '%s'\n", what, max, s);
		exit(2);
	}
	return v;
}

static long value(const char *s, const char *what)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(s, &end, 0);
	if (errno || end == s || *end) {
		fprintf(stderr, "uprog: %s must be a number, not '%s'\n", what, s);
		exit(2);
	}
	return v;
}

static void add_extra(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void add_extra(const char *fmt, ...)
{
	va_list ap;
	size_t used = strlen(extra);

	va_start(ap, fmt);
	vsnprintf(extra + used, sizeof(extra) - used, fmt, ap);
	va_end(ap);
}

/* The summary line; the exit status says whether every return was right. */
static int report(unsigned long n, long ret, unsigned long calls)
{
	printf("uprog mode=%s build=%s n=%lu pid=%d ret=%ld calls=%lu bad=%lu%s\n", mode_name, BUILD,
	       n, (int)getpid(), ret, calls, bad, extra);
	fflush(stdout);
	return bad ? 3 : 0;
}

static void setup_failed(const char *what)
{
	printf("uprog mode=%s build=%s pid=%d setup=failed what=%s errno=%d\n", mode_name, BUILD,
	       (int)getpid(), what, errno);
	exit(1);
}

/* N calls of qpt_target(A+i, B, S) through fn; returns the last result. */
static long call_target(long (*fn)(long, long, const char *), unsigned long n, long a, long b,
			const char *s)
{
	long ret = 0;

	for (unsigned long i = 0; i < n; i++) {
		ret = fn(a + (long)i, b, s);
		if (ret != a + (long)i + b)
			bad++;
	}
	return ret;
}

static long call_lib(unsigned long n, long a, long b)
{
	long ret = 0;

	for (unsigned long i = 0; i < n; i++) {
		ret = qpt_lib_add(a + (long)i, b);
		if (ret != a + (long)i + b)
			bad++;
	}
	return ret;
}

static int do_call(unsigned long n, long a, long b, const char *s)
{
	long ret = call_target(qpt_target, n, a, b, s);

	add_extra(" a=%ld b=%ld s=%s", a, b, s);
	return report(n, ret, n);
}

static int do_lib(unsigned long n, long a, long b)
{
	long ret = call_lib(n, a, b);

	add_extra(" a=%ld b=%ld", a, b);
	return report(n, ret, n);
}

static int do_recurse(unsigned long depth)
{
	long ret = qpt_recurse((long)depth);

	if (ret != (long)depth)
		bad++;
	return report(depth, ret, depth + 1);
}

static int do_fork(unsigned long n, unsigned long m)
{
	unsigned long calls, reaped = 0, crashed = 0;
	long ret;

	for (unsigned long k = 1; k <= n; k++) {
		pid_t child = fork();
		if (child < 0)
			setup_failed("fork");
		if (child == 0) {
			ret = call_target(qpt_target, m, 0, (long)k, "fork");
			printf("uprog-child pid=%d ppid=%d k=%lu calls=%lu ret=%ld bad=%lu\n",
			       (int)getpid(), (int)getppid(), k, m, ret, bad);
			fflush(stdout);
			_exit(bad ? 3 : 0);
		}
	}
	ret = call_target(qpt_target, m, 0, 0, "fork");
	calls = m;
	for (;;) {
		int status;
		pid_t child = wait(&status);
		if (child < 0)
			break;
		reaped++;
		if (WIFEXITED(status))
			calls += m;
		if (WIFEXITED(status) && WEXITSTATUS(status) == 3)
			bad++;
		if (WIFSIGNALED(status))
			crashed++;
	}
	add_extra(" m=%lu children=%lu crashed=%lu", m, reaped, crashed);
	return report(n, ret, calls);
}

static int do_wait_then_call(unsigned long seconds, unsigned long n)
{
	long ret;

	/* The host reads this line to learn the pid, then registers its probes. */
	printf("uprog pid=%d target=%p lib=%p\n", (int)getpid(), (void *)qpt_target,
	       (void *)qpt_lib_add);
	fflush(stdout);
	sleep((unsigned int)seconds);
	ret = call_target(qpt_target, n, 0, 0, "wait");
	call_lib(n, 0, 0);
	add_extra(" seconds=%lu lib_calls=%lu", seconds, n);
	return report(n, ret, n);
}

static int do_selfmod(unsigned long n)
{
	long page_size = sysconf(_SC_PAGESIZE);
	unsigned char *fn = (unsigned char *)qpt_target;
	uintptr_t start = (uintptr_t)fn & ~(uintptr_t)(page_size - 1);
	/* Two pages if the function's first bytes cross a page boundary. */
	size_t len = (size_t)(((uintptr_t)fn + 16 - start + (uintptr_t)page_size - 1) &
			      ~(uintptr_t)(page_size - 1));
	long ret;

	/* PROT_EXEC stays on: this code may share the page. */
	if (mprotect((void *)start, len, PROT_READ | PROT_WRITE | PROT_EXEC))
		setup_failed("mprotect-write");
	/* The same bytes back: the write makes the page a private copy (a debugger's poke). */
	for (int i = 0; i < 16; i++)
		((volatile unsigned char *)fn)[i] = ((volatile unsigned char *)fn)[i];
	if (mprotect((void *)start, len, PROT_READ | PROT_EXEC))
		setup_failed("mprotect-exec");
	ret = call_target(qpt_target, n, 0, 0, "selfmod");
	add_extra(" page=%#lx pages=%lu", (unsigned long)start, (unsigned long)(len / (size_t)page_size));
	return report(n, ret, n);
}

/* The file offset of qpt_target, from the mapping /proc/self/maps shows it in. */
static long target_file_offset(void)
{
	uintptr_t addr = (uintptr_t)qpt_target;
	char line[512];
	FILE *maps = fopen("/proc/self/maps", "r");
	long found = -1;

	if (!maps)
		setup_failed("open-maps");
	while (fgets(line, sizeof(line), maps)) {
		unsigned long lo, hi, off;
		if (sscanf(line, "%lx-%lx %*s %lx", &lo, &hi, &off) == 3 && addr >= lo && addr < hi) {
			found = (long)(addr - lo + off);
			break;
		}
	}
	fclose(maps);
	if (found < 0)
		setup_failed("find-target");
	return found;
}

static int do_remap(unsigned long n)
{
	long page_size = sysconf(_SC_PAGESIZE);
	long file_off = target_file_offset();
	long map_off = file_off & ~(page_size - 1);
	size_t len = (size_t)(2 * page_size);
	char exe[PATH_MAX];
	ssize_t got = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	long (*alias)(long, long, const char *);
	void *map;
	long ret;
	int fd;

	if (got < 0)
		setup_failed("readlink-exe");
	exe[got] = '\0';
	fd = open(exe, O_RDONLY);
	if (fd < 0)
		setup_failed("open-exe");
	map = mmap(NULL, len, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, map_off);
	close(fd);
	if (map == MAP_FAILED)
		setup_failed("mmap");
	alias = (long (*)(long, long, const char *))((char *)map + (file_off - map_off));
	ret = call_target(alias, n, 0, 0, "remap");
	if (munmap(map, len))
		setup_failed("munmap");
	add_extra(" alias=%p offset=%#lx", (void *)alias, (unsigned long)file_off);
	return report(n, ret, n);
}

static int do_exec(unsigned long n, const char *arg)
{
	char exe[PATH_MAX];
	ssize_t got = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
	long ret = call_target(qpt_target, n, 0, 0, "pre-exec");

	if (got < 0)
		setup_failed("readlink-exe");
	exe[got] = '\0';
	printf("uprog-exec pid=%d calls=%lu ret=%ld bad=%lu exe=%s\n", (int)getpid(), n, ret, bad, exe);
	fflush(stdout);
	/* The exe's own path, not /proc/self/exe: comm stays "uprog". */
	execl(exe, exe, "call", arg, "0", "0", "exec", (char *)NULL);
	setup_failed("exec");
	return 1;
}

struct thread_arg {
	unsigned long k, n, bad;
	long ret;
};

static void *thread_main(void *p)
{
	struct thread_arg *t = p;

	for (unsigned long i = 0; i < t->n; i++) {
		t->ret = qpt_target((long)i, (long)t->k, "thread");
		if (t->ret != (long)(i + t->k))
			t->bad++;
	}
	return NULL;
}

static int do_threads(unsigned long nthreads, unsigned long n)
{
	pthread_t tid[MAX_PROCS];
	struct thread_arg args[MAX_PROCS];
	long ret = 0;

	for (unsigned long k = 0; k < nthreads; k++) {
		args[k] = (struct thread_arg){ .k = k + 1, .n = n };
		errno = pthread_create(&tid[k], NULL, thread_main, &args[k]);
		if (errno)
			setup_failed("pthread_create");
	}
	for (unsigned long k = 0; k < nthreads; k++) {
		pthread_join(tid[k], NULL);
		bad += args[k].bad;
		ret = args[k].ret;
	}
	add_extra(" threads=%lu", nthreads);
	return report(n, ret, nthreads * n);
}

static int do_getppid(unsigned long n)
{
	long ret = 0;

	for (unsigned long i = 0; i < n; i++)
		ret = getppid();
	return report(n, ret, n);
}

int main(int argc, char **argv)
{
	const char *mode;

	if (argc < 2)
		usage();
	mode = mode_name = argv[1];
	/* Line-buffered stdout: the host reads a console, and fork copies no pending output. */
	setvbuf(stdout, NULL, _IOLBF, 0);

	if (!strcmp(mode, "call") && argc == 6)
		return do_call(count(argv[2], "N", MAX_COUNT), value(argv[3], "A"),
			       value(argv[4], "B"), argv[5]);
	if (!strcmp(mode, "lib") && (argc == 3 || argc == 5))
		return do_lib(count(argv[2], "N", MAX_COUNT), argc == 5 ? value(argv[3], "A") : 0,
			      argc == 5 ? value(argv[4], "B") : 1);
	if (!strcmp(mode, "recurse") && argc == 3)
		return do_recurse(count(argv[2], "DEPTH", MAX_DEPTH));
	if (!strcmp(mode, "fork") && argc == 4)
		return do_fork(count(argv[2], "N", MAX_PROCS), count(argv[3], "M", MAX_COUNT));
	if (!strcmp(mode, "wait-then-call") && argc == 4)
		return do_wait_then_call(count(argv[2], "SECONDS", 3600),
					 count(argv[3], "N", MAX_COUNT));
	if (!strcmp(mode, "selfmod") && argc == 3)
		return do_selfmod(count(argv[2], "N", MAX_COUNT));
	if (!strcmp(mode, "remap") && argc == 3)
		return do_remap(count(argv[2], "N", MAX_COUNT));
	if (!strcmp(mode, "exec") && argc == 3)
		return do_exec(count(argv[2], "N", MAX_COUNT), argv[2]);
	if (!strcmp(mode, "threads") && argc == 4)
		return do_threads(count(argv[2], "T", MAX_PROCS), count(argv[3], "N", MAX_COUNT));
	if (!strcmp(mode, "getppid") && argc == 3)
		return do_getppid(count(argv[2], "N", MAX_COUNT));
	usage();
	return 2;
}
