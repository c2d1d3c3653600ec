/*
 * workload: the guest program qprobe's tests run to make the kernel do
 * something known.  Each mode calls one system call a given number of times
 * and ends with exactly one summary line of key=value pairs, e.g.
 *
 *     workload mode=getppid n=100 pid=57 ret=1 errors=0
 *
 * so the host can compare what a probe saw with what really happened.
 * Failed calls are counted, and their errno names listed
 * ("errnos=ENOENT:3,EPERM:1"), so tests that inject faults (override a
 * return value from a probe) can check the program observed them.
 *
 * Any mode may be suffixed with "-fail" (getpid-fail, open-fail, ...): it
 * runs the same calls; the suffix only documents that the caller expects
 * failures, and is echoed back in mode=.
 *
 * Built on the host with:  gcc -static -O2 -Wall -o workload workload.c
 * Exit status: 0 when the mode ran (even if calls failed), 1 when its setup
 * failed (e.g. a file could not be created), 2 on a usage error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __x86_64__
#include <cpuid.h>
#endif

#define MAX_ERRNO 4096

static const char *mode_name;      /* as given on the command line */
static unsigned long errors;       /* calls that failed */
static unsigned long errno_count[MAX_ERRNO];
static char extra[512];            /* mode specific key=value pairs */

static void usage(void)
{
	fputs("usage: workload MODE ARGS...\n"
	      "  getppid N              call getppid N times\n"
	      "  getpid N               call getpid N times\n"
	      "  lseek N [PATH]         lseek(fd, i, SEEK_SET) for i=1..N on a new file\n"
	      "  read N SIZE [PATH]     read SIZE bytes N times (default /dev/zero)\n"
	      "  write N SIZE [PATH]    write SIZE bytes N times (default /dev/null)\n"
	      "  open N PATH            open+close PATH N times\n"
	      "  fork N                 fork and wait for N children\n"
	      "  pid [N]                print the pid, then call getppid N times\n"
	      "  spin SECONDS           call getppid in a loop for SECONDS\n"
	      "  cx16                   whether the CPU offers cmpxchg16b, and the flags it leaves\n"
	      "any MODE may end in -fail (open-fail N PATH): same calls, failures expected\n",
	      stderr);
	exit(2);
}

static unsigned long number(const char *s, const char *what)
{
	char *end;
	unsigned long v;

	errno = 0;
	v = strtoul(s, &end, 0);
	if (errno || end == s || *end || s[0] == '-') {
		fprintf(stderr, "workload: %s must be a number, not '%s'\n", what, s);
		exit(2);
	}
	return v;
}

/* errno names for the values fault-injection tests are likely to use. */
static const char *errno_name(int e)
{
	switch (e) {
	case EPERM: return "EPERM";
	case ENOENT: return "ENOENT";
	case ESRCH: return "ESRCH";
	case EINTR: return "EINTR";
	case EIO: return "EIO";
	case ENXIO: return "ENXIO";
	case E2BIG: return "E2BIG";
	case EBADF: return "EBADF";
	case ECHILD: return "ECHILD";
	case EAGAIN: return "EAGAIN";
	case ENOMEM: return "ENOMEM";
	case EACCES: return "EACCES";
	case EFAULT: return "EFAULT";
	case EBUSY: return "EBUSY";
	case EEXIST: return "EEXIST";
	case ENODEV: return "ENODEV";
	case ENOTDIR: return "ENOTDIR";
	case EISDIR: return "EISDIR";
	case EINVAL: return "EINVAL";
	case ENFILE: return "ENFILE";
	case EMFILE: return "EMFILE";
	case ENOSPC: return "ENOSPC";
	case ESPIPE: return "ESPIPE";
	case EROFS: return "EROFS";
	case ERANGE: return "ERANGE";
	case ENOSYS: return "ENOSYS";
	case ENAMETOOLONG: return "ENAMETOOLONG";
	case ELOOP: return "ELOOP";
	case EOVERFLOW: return "EOVERFLOW";
	case ETIMEDOUT: return "ETIMEDOUT";
	default: return NULL;
	}
}

/* Record the outcome of one call; returns ret unchanged. */
static long note(long ret)
{
	if (ret < 0) {
		errors++;
		if (errno > 0 && errno < MAX_ERRNO)
			errno_count[errno]++;
	}
	return ret;
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

static void report(unsigned long n, long ret)
{
	printf("workload mode=%s n=%lu pid=%d ret=%ld errors=%lu", mode_name, n,
	       (int)getpid(), ret, errors);
	if (errors) {
		const char *sep = " errnos=";
		for (int e = 1; e < MAX_ERRNO; e++) {
			if (!errno_count[e])
				continue;
			const char *name = errno_name(e);
			if (name)
				printf("%s%s:%lu", sep, name, errno_count[e]);
			else
				printf("%sE%d:%lu", sep, e, errno_count[e]);
			sep = ",";
		}
	}
	printf("%s\n", extra);
	fflush(stdout);
}

static void setup_failed(const char *what, const char *path)
{
	int e = errno;
	const char *name = errno_name(e);

	printf("workload mode=%s pid=%d setup=failed what=%s path=%s errno=%s\n", mode_name,
	       (int)getpid(), what, path, name ? name : strerror(e));
	exit(1);
}

static int do_syscall0(int nr, unsigned long n)
{
	long ret = 0;

	for (unsigned long i = 0; i < n; i++)
		ret = note(syscall(nr));
	report(n, ret);
	return 0;
}

static int do_lseek(unsigned long n, const char *path)
{
	long ret = 0;
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);

	if (fd < 0)
		setup_failed("open", path);
	for (unsigned long i = 1; i <= n; i++)
		ret = note(lseek(fd, (off_t)i, SEEK_SET));
	close(fd);
	add_extra(" fd=%d path=%s", fd, path);
	report(n, ret);
	return 0;
}

/* Make sure PATH exists and holds at least size bytes, so reads return data. */
static void prepare_file(const char *path, unsigned long size)
{
	struct stat st;
	char block[4096];
	int fd;

	if (stat(path, &st) == 0)
		return;
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0)
		setup_failed("create", path);
	memset(block, 'q', sizeof(block));
	while (size) {
		size_t chunk = size < sizeof(block) ? size : sizeof(block);
		ssize_t w = write(fd, block, chunk);
		if (w <= 0)
			setup_failed("fill", path);
		size -= (unsigned long)w;
	}
	close(fd);
}

static int do_read(unsigned long n, unsigned long size, const char *path)
{
	unsigned long total = 0;
	long ret = 0;
	char *buf = malloc(size ? size : 1);
	int fd;

	if (!buf)
		setup_failed("malloc", path);
	prepare_file(path, n * size);
	fd = open(path, O_RDONLY);
	if (fd < 0)
		setup_failed("open", path);
	for (unsigned long i = 0; i < n; i++) {
		ret = note(read(fd, buf, size));
		if (ret > 0)
			total += (unsigned long)ret;
	}
	close(fd);
	add_extra(" fd=%d size=%lu bytes=%lu path=%s", fd, size, total, path);
	report(n, ret);
	return 0;
}

static int do_write(unsigned long n, unsigned long size, const char *path)
{
	unsigned long total = 0;
	long ret = 0;
	char *buf = malloc(size ? size : 1);
	int fd;

	if (!buf)
		setup_failed("malloc", path);
	memset(buf, 'w', size ? size : 1);
	fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0)
		setup_failed("open", path);
	for (unsigned long i = 0; i < n; i++) {
		ret = note(write(fd, buf, size));
		if (ret > 0)
			total += (unsigned long)ret;
	}
	close(fd);
	add_extra(" fd=%d size=%lu bytes=%lu path=%s", fd, size, total, path);
	report(n, ret);
	return 0;
}

static int do_open(unsigned long n, const char *path)
{
	unsigned long opened = 0;
	long ret = 0;

	for (unsigned long i = 0; i < n; i++) {
		ret = note(open(path, O_RDONLY));
		if (ret >= 0) {
			opened++;
			close((int)ret);
		}
	}
	add_extra(" opened=%lu path=%s", opened, path);
	report(n, ret);
	return 0;
}

static int do_fork(unsigned long n)
{
	unsigned long reaped = 0;
	long ret = 0;

	for (unsigned long i = 0; i < n; i++) {
		pid_t child = (pid_t)note(fork());
		if (child == 0)
			_exit(0);
		ret = child;
		if (child > 0 && waitpid(child, NULL, 0) == child)
			reaped++;
	}
	add_extra(" children=%lu", reaped);
	report(n, ret);
	return 0;
}

static int do_pid(unsigned long n)
{
	long ret = 0;

	/* The host reads this first line to learn which pid to filter on. */
	printf("workload pid=%d\n", (int)getpid());
	fflush(stdout);
	for (unsigned long i = 0; i < n; i++)
		ret = note(syscall(SYS_getppid));
	report(n, ret);
	return 0;
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int do_spin(unsigned long seconds)
{
	unsigned long count = 0;
	long ret = 0;
	double end = now() + (double)seconds;

	while (now() < end) {
		/* Check the clock every 64 calls: the calls are what we want to run. */
		for (int i = 0; i < 64; i++)
			ret = note(syscall(SYS_getppid));
		count += 64;
	}
	add_extra(" seconds=%lu count=%lu", seconds, count);
	report(count, ret);
	return 0;
}

/*
 * QEMU 7.2's TCG computes cmpxchg16b's flags from the condition-code state
 * the translation block started with, not the one the instructions before it
 * left: after a popf ends a block and an add sets new flags, EFLAGS takes the
 * add's operand, the low half of a pointer, with VM, AC, TF or DF set.  A
 * kernel's unlocked per-CPU cmpxchg16b (SLUB's fast path) then double-faults.
 * Prints cx16=0 where CPUID does not offer the instruction, else cx16=1 and
 * the flags after it (a successful compare: ZF and IF set).
 */
static int do_cx16(void)
{
#ifdef __x86_64__
	unsigned int a, b, c, d;
	static unsigned long long pair[2] __attribute__((aligned(16))) = {0x1111, 0x2222};
	unsigned long flags = 0;

	if (__get_cpuid(1, &a, &b, &c, &d) && (c & bit_CMPXCHG16B)) {
		/* Below the red zone the compiler may keep data in, push and pop are safe. */
		__asm__ volatile("sub $128, %%rsp\n\t"
				 "push $0x202\n\t"
				 "popfq\n\t"
				 "movabs $0x1234567855f61b08, %%rbx\n\t"
				 "xor %%eax, %%eax\n\t"
				 "add %%rbx, %%rax\n\t"
				 "mov (%[pair]), %%rax\n\t"
				 "mov 8(%[pair]), %%rdx\n\t"
				 "mov %%rax, %%rbx\n\t"
				 "mov %%rdx, %%rcx\n\t"
				 "cmpxchg16b (%[pair])\n\t"
				 "pushfq\n\t"
				 "pop %[flags]\n\t"
				 "add $128, %%rsp"
				 : [flags] "=r"(flags)
				 : [pair] "r"(pair)
				 : "rax", "rbx", "rcx", "rdx", "memory", "cc");
		add_extra(" cx16=1 flags=%#lx", flags);
		report(1, 0);
		return 0;
	}
#endif
	add_extra(" cx16=0");
	report(0, 0);
	return 0;
}

int main(int argc, char **argv)
{
	char mode[64];
	size_t len;

	if (argc < 2)
		usage();
	mode_name = argv[1];
	len = strlen(mode_name);
	if (len >= sizeof(mode))
		usage();
	strcpy(mode, mode_name);
	if (len > 5 && strcmp(mode + len - 5, "-fail") == 0)
		mode[len - 5] = '\0';

	/* Unbuffered stderr, line-buffered stdout: the host reads a console. */
	setvbuf(stdout, NULL, _IOLBF, 0);

	if (!strcmp(mode, "getppid") && argc == 3)
		return do_syscall0(SYS_getppid, number(argv[2], "N"));
	if (!strcmp(mode, "getpid") && argc == 3)
		return do_syscall0(SYS_getpid, number(argv[2], "N"));
	if (!strcmp(mode, "lseek") && (argc == 3 || argc == 4))
		return do_lseek(number(argv[2], "N"), argc == 4 ? argv[3] : "/tmp/qprobe-lseek");
	if (!strcmp(mode, "read") && (argc == 4 || argc == 5))
		return do_read(number(argv[2], "N"), number(argv[3], "SIZE"),
			       argc == 5 ? argv[4] : "/dev/zero");
	if (!strcmp(mode, "write") && (argc == 4 || argc == 5))
		return do_write(number(argv[2], "N"), number(argv[3], "SIZE"),
				argc == 5 ? argv[4] : "/dev/null");
	if (!strcmp(mode, "open") && argc == 4)
		return do_open(number(argv[2], "N"), argv[3]);
	if (!strcmp(mode, "fork") && argc == 3)
		return do_fork(number(argv[2], "N"));
	if (!strcmp(mode, "pid") && (argc == 2 || argc == 3))
		return do_pid(argc == 3 ? number(argv[2], "N") : 1);
	if (!strcmp(mode, "spin") && argc == 3)
		return do_spin(number(argv[2], "SECONDS"));
	if (!strcmp(mode, "cx16") && argc == 2)
		return do_cx16();
	usage();
	return 2;
}
