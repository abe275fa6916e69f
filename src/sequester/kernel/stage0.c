/*
 * sequester's native first stage: confine this process, then become the cell runner.
 *
 * The same job as sequester/kernel/boot.py (the Python first stage), without a Python
 * interpreter of its own: bwrap execs this program, which applies a plan of system calls
 * the host computed (sequester/guard/native_plan.py) and execs the cell runner's
 * Python. One interpreter start per kernel instead of two, and no ctypes anywhere.
 *
 * It decides nothing: every path, flag, limit, the seccomp program and the cell
 * runner's command line come from the host, in order, on IN_FD. It is a dumb executor,
 * so the security argument (which steps, in which order) lives in the host's planner,
 * pure Python with unit tests; the same properties are tested on kernels started
 * through either stage.
 *
 * Usage: stage0 IN_FD OUT_FD. IN_FD carries one frame: a 4-byte big-endian length, then
 * ops. An op is a u32 opcode, a u32 argument count, then each argument as a u32 length
 * (0xffffffff: NULL) and its bytes; every integer is in decimal text. Little-endian u32s.
 * Any failure is told to the host on OUT_FD as the kernel protocol's "failed" message
 * (4-byte big-endian length, JSON), then the process exits 70: fail closed.
 *
 * The execve into the cell runner names its path at HANDOFF_ADDRESS, the one address
 * the seccomp filter lets execve through (see sequester/guard/handoff.py).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define HANDOFF_ADDRESS 0x300000000000UL
#define PAGE 4096
#define MAX_FRAME (4u << 20)
#define MAX_ARGS 64
#define MAX_EXEC 4096
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

/* native_plan.Op's numbers (6 is unused). */
enum {
    OP_UNSHARE = 1, OP_MOUNT = 2, OP_UMOUNT = 3, OP_MKDIR = 4, OP_MKDIR_MISSING = 5, OP_CHDIR = 7,
    OP_LOOPBACK_UP = 8, OP_WRITE = 9, OP_RLIMIT = 10, OP_CHOWN = 11, OP_DROP_BOUNDING = 12, OP_SETIDS = 13,
    OP_CLEAR_CAPS = 14, OP_CHECK_NO_CAPS = 15, OP_NO_NEW_PRIVS = 16, OP_SECCOMP = 17, OP_ARG = 18, OP_EXEC = 19,
    OP_MOUNTPOINT = 20, OP_LANDLOCK = 21,
};

/* Landlock's ABI (linux/landlock.h, not needed at build time): the three system calls
 * have the same numbers on every architecture. */
#define SYS_LANDLOCK_CREATE_RULESET 444
#define SYS_LANDLOCK_ADD_RULE 445
#define SYS_LANDLOCK_RESTRICT_SELF 446
#define LANDLOCK_RULE_PATH_BENEATH 1
#define LANDLOCK_WRITE_FILE (1ULL << 1)
#define LANDLOCK_MAKE_CHAR (1ULL << 6)
#define LANDLOCK_MAKE_BLOCK (1ULL << 11)
#define LANDLOCK_TRUNCATE (1ULL << 14)
struct landlock_path_beneath { uint64_t allowed_access; int32_t parent_fd; } __attribute__((packed));

static int out_fd = -1;
static uint64_t started_ns;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        buf += n;
        len -= (size_t)n;
    }
}

/* The kernel protocol's {"op": "failed", "error": ...}; the text is JSON-escaped, and
 * bytes outside printable ASCII become '?' (the host parses this as untrusted). */
static void __attribute__((noreturn)) fail(const char *what, const char *detail, int err) {
    char text[1024], body[2400];
    snprintf(text, sizeof text, "stage 0: %s%s%s%s%s", what, detail ? " " : "", detail ? detail : "",
             err ? ": " : "", err ? strerror(err) : "");
    size_t n = (size_t)snprintf(body, sizeof body, "{\"op\":\"failed\",\"error\":\"");
    for (const unsigned char *p = (const unsigned char *)text; *p && n < sizeof body - 8; p++) {
        if (*p == '"' || *p == '\\') { body[n++] = '\\'; body[n++] = (char)*p; }
        else if (*p < 0x20 || *p > 0x7e) body[n++] = '?';
        else body[n++] = (char)*p;
    }
    body[n++] = '"'; body[n++] = '}';
    if (out_fd >= 0) {
        unsigned char header[4] = {(unsigned char)(n >> 24), (unsigned char)(n >> 16), (unsigned char)(n >> 8),
                                   (unsigned char)n};
        write_all(out_fd, (const char *)header, 4);
        write_all(out_fd, body, n);
    }
    _exit(70);
}

static void read_exactly(int fd, unsigned char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = read(fd, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail("reading the plan", NULL, errno);
        if (n == 0) _exit(0); /* the host went away before sending a plan: nothing to do */
        buf += n;
        len -= (size_t)n;
    }
}

struct cursor { const unsigned char *p, *end; };

static uint32_t take_u32(struct cursor *c) {
    if ((size_t)(c->end - c->p) < 4) fail("the plan is truncated", NULL, 0);
    uint32_t v = (uint32_t)c->p[0] | (uint32_t)c->p[1] << 8 | (uint32_t)c->p[2] << 16 | (uint32_t)c->p[3] << 24;
    c->p += 4;
    return v;
}

/* Arguments are copied out NUL-terminated (NULL for a NULL argument); lengths kept. */
struct op { uint32_t code, argc; char *argv[MAX_ARGS]; uint32_t len[MAX_ARGS]; };

static void take_op(struct cursor *c, struct op *op) {
    op->code = take_u32(c);
    op->argc = take_u32(c);
    if (op->argc > MAX_ARGS) fail("an op has too many arguments", NULL, 0);
    for (uint32_t i = 0; i < op->argc; i++) {
        uint32_t len = take_u32(c);
        if (len == 0xffffffffu) { op->argv[i] = NULL; op->len[i] = 0; continue; }
        if ((size_t)(c->end - c->p) < len) fail("the plan is truncated", NULL, 0);
        char *s = malloc((size_t)len + 1);
        if (!s) fail("out of memory", NULL, ENOMEM);
        memcpy(s, c->p, len);
        s[len] = '\0';
        c->p += len;
        op->argv[i] = s;
        op->len[i] = len;
    }
}

static const char *arg(const struct op *op, uint32_t i) {
    if (i >= op->argc) fail("an op is missing an argument", NULL, 0);
    return op->argv[i];
}

static const char *text_arg(const struct op *op, uint32_t i) {
    const char *s = arg(op, i);
    if (!s) fail("an op has a NULL where text is needed", NULL, 0);
    return s;
}

static unsigned long long int_arg(const struct op *op, uint32_t i) {
    const char *s = text_arg(op, i), *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, (char **)&end, 10);
    if (errno || end == s || *end) fail("an op has a bad number:", s, 0);
    return v;
}

static void check(int result, const char *what, const char *detail) {
    if (result != 0) fail(what, detail, errno);
}

/* mkdir, then chmod: the mode is not narrowed by the umask. */
static void make_dir(const char *path, mode_t mode) {
    check(mkdir(path, mode), "mkdir", path);
    check(chmod(path, mode), "chmod", path);
}

static void loopback_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) fail("socket for loopback", NULL, errno);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    ifr.ifr_flags = IFF_UP;
    check(ioctl(s, SIOCSIFFLAGS, &ifr), "bringing up loopback", NULL);
    close(s);
}

static void write_file(const char *path, const char *data, size_t len) {
    int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) fail("open", path, errno);
    if (write(fd, data, len) != (ssize_t)len) fail("write", path, errno);
    close(fd);
}

static void lower_rlimit(int resource, unsigned long long value) {
    struct rlimit now;
    check(getrlimit(resource, &now), "getrlimit", NULL);
    rlim_t v = (rlim_t)value;
    if (now.rlim_max != RLIM_INFINITY && now.rlim_max < v) v = now.rlim_max;
    struct rlimit next = {v, v};
    check(setrlimit(resource, &next), "setrlimit", NULL);
}

static void drop_bounding_set(void) {
    char buf[32] = {0};
    int fd = open("/proc/sys/kernel/cap_last_cap", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, buf, sizeof buf - 1) <= 0) fail("reading cap_last_cap", NULL, errno);
    close(fd);
    int last = atoi(buf);
    for (int cap = 0; cap <= last; cap++) {
        int in_set = prctl(PR_CAPBSET_READ, cap, 0, 0, 0);
        if (in_set == 1 && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
            char name[16];
            snprintf(name, sizeof name, "%d", cap);
            fail("dropping from the bounding set capability", name, errno);
        }
    }
}

static void clear_capabilities(void) {
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    check((int)syscall(SYS_capset, &header, data), "capset", NULL);
    check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities", NULL);
}

/* Every capability set of /proc/self/status must read zero. */
static void check_no_capabilities(void) {
    char buf[8192];
    int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("open /proc/self/status", NULL, errno);
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) fail("read /proc/self/status", NULL, errno);
    buf[n] = '\0';
    static const char *const sets[] = {"CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"};
    for (size_t i = 0; i < sizeof sets / sizeof *sets; i++) {
        char *line = strstr(buf, sets[i]);
        if (!line) fail("no capability line", sets[i], 0);
        line += strlen(sets[i]);
        while (*line == '\t' || *line == ' ') line++;
        for (; *line && *line != '\n'; line++)
            if (*line != '0') fail("capabilities remain after the drop:", sets[i], 0);
    }
}

/* handled: the rights the ruleset restricts (the host's planner: every write right of
 * this machine's ABI); paths: where they stay allowed. Needs no_new_privs. */
static void landlock_writes(const struct op *op) {
    uint64_t handled = int_arg(op, 0);
    long ruleset = syscall(SYS_LANDLOCK_CREATE_RULESET, &handled, sizeof handled, 0);
    if (ruleset < 0) fail("landlock_create_ruleset", NULL, errno);
    for (uint32_t i = 1; i < op->argc; i++) {
        const char *path = text_arg(op, i);
        int fd = open(path, O_PATH | O_CLOEXEC);
        if (fd < 0) fail("open for Landlock", path, errno);
        struct stat st;
        if (fstat(fd, &st) != 0) fail("fstat for Landlock", path, errno);
        struct landlock_path_beneath rule = {
            S_ISDIR(st.st_mode) ? handled & ~(LANDLOCK_MAKE_CHAR | LANDLOCK_MAKE_BLOCK)
                                : handled & (LANDLOCK_WRITE_FILE | LANDLOCK_TRUNCATE),
            fd};
        if (syscall(SYS_LANDLOCK_ADD_RULE, (int)ruleset, LANDLOCK_RULE_PATH_BENEATH, &rule, 0) != 0)
            fail("landlock_add_rule", path, errno);
        close(fd);
    }
    if (syscall(SYS_LANDLOCK_RESTRICT_SELF, (int)ruleset, 0) != 0) fail("landlock_restrict_self", NULL, errno);
    close((int)ruleset);
}

static void load_seccomp(const char *program, size_t len) {
    if (len == 0 || len % sizeof(struct sock_filter) || len / sizeof(struct sock_filter) > 0xffff)
        fail("the seccomp program is not a whole number of instructions", NULL, 0);
    struct sock_fprog prog = {(unsigned short)(len / sizeof(struct sock_filter)), (struct sock_filter *)program};
    long r = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog);
    if (r != 0) fail("seccomp(SET_MODE_FILTER)", NULL, r > 0 ? EAGAIN : errno);
}

int main(int argc, char **argv) {
    started_ns = now_ns();
    if (argc != 3) {
        static const char usage[] = "usage: stage0 IN_FD OUT_FD (sequester's kernel first stage)\n";
        write_all(2, usage, sizeof usage - 1);
        return 2;
    }
    int in_fd = atoi(argv[1]);
    out_fd = atoi(argv[2]);
    unsigned char header[4];
    read_exactly(in_fd, header, 4);
    uint32_t size = (uint32_t)header[0] << 24 | (uint32_t)header[1] << 16 | (uint32_t)header[2] << 8 | header[3];
    if (size > MAX_FRAME) fail("the plan is over its size limit", NULL, 0);
    unsigned char *frame = malloc(size ? size : 1);
    if (!frame) fail("out of memory", NULL, ENOMEM);
    read_exactly(in_fd, frame, size);
    struct cursor c = {frame, frame + size};

    char *exec_argv[MAX_EXEC + 2];
    size_t n_argv = 0;
    while (c.p < c.end) {
        struct op op;
        take_op(&c, &op);
        switch (op.code) {
        case OP_UNSHARE:
            check(unshare((int)int_arg(&op, 0)), "unshare", NULL);
            break;
        case OP_MOUNT:
            check(mount(arg(&op, 0), text_arg(&op, 1), arg(&op, 2), (unsigned long)int_arg(&op, 3), arg(&op, 4)),
                  "mount", text_arg(&op, 1));
            break;
        case OP_UMOUNT:
            check(umount2(text_arg(&op, 0), (int)int_arg(&op, 1)), "umount", text_arg(&op, 0));
            break;
        case OP_MKDIR:
            make_dir(text_arg(&op, 0), (mode_t)int_arg(&op, 1));
            break;
        case OP_MKDIR_MISSING: {
            struct stat st;
            if (lstat(text_arg(&op, 0), &st) != 0) make_dir(text_arg(&op, 0), (mode_t)int_arg(&op, 1));
            break;
        }
        case OP_CHDIR:
            check(chdir(text_arg(&op, 0)), "chdir", text_arg(&op, 0));
            break;
        case OP_LOOPBACK_UP:
            loopback_up();
            break;
        case OP_WRITE:
            write_file(text_arg(&op, 0), text_arg(&op, 1), op.len[1]);
            break;
        case OP_RLIMIT:
            lower_rlimit((int)int_arg(&op, 0), int_arg(&op, 1));
            break;
        case OP_CHOWN:
            check(chown(text_arg(&op, 0), (uid_t)int_arg(&op, 1), (gid_t)int_arg(&op, 2)), "chown", text_arg(&op, 0));
            break;
        case OP_DROP_BOUNDING:
            drop_bounding_set();
            break;
        case OP_SETIDS: { /* uid gid: groups, then gid, then uid (which clears the capability sets) */
            uid_t uid = (uid_t)int_arg(&op, 0);
            gid_t gid = (gid_t)int_arg(&op, 1);
            if (getgroups(0, NULL) > 0) check(setgroups(0, NULL), "setgroups", NULL);
            check(setresgid(gid, gid, gid), "setresgid", NULL);
            check(setresuid(uid, uid, uid), "setresuid", NULL);
            /* A uid change clears bwrap's parent-death signal, and the kernel is its
             * namespace's pid 1: without it again, a kernel busy in a cell would outlive
             * its host process. */
            check(prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)", NULL);
            break;
        }
        case OP_CLEAR_CAPS:
            clear_capabilities();
            break;
        case OP_CHECK_NO_CAPS:
            check_no_capabilities();
            break;
        case OP_NO_NEW_PRIVS:
            check(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)", NULL);
            break;
        case OP_SECCOMP:
            load_seccomp(text_arg(&op, 0), op.len[0]);
            break;
        case OP_LANDLOCK:
            landlock_writes(&op);
            break;
        case OP_ARG:
            if (n_argv >= MAX_EXEC) fail("too many arguments for the cell runner", NULL, 0);
            exec_argv[n_argv++] = (char *)text_arg(&op, 0);
            break;
        case OP_MOUNTPOINT: { /* target source: a folder or an empty file, as source is */
            struct stat st;
            check(stat(text_arg(&op, 1), &st), "stat", text_arg(&op, 1));
            if (S_ISDIR(st.st_mode)) {
                check(mkdir(text_arg(&op, 0), 0755), "mkdir", text_arg(&op, 0));
            } else {
                int fd = open(text_arg(&op, 0), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
                if (fd < 0) fail("create", text_arg(&op, 0), errno);
                close(fd);
            }
            break;
        }
        case OP_EXEC: {
            /* The last op: the path goes to the one address the filter lets execve take. */
            const char *path = text_arg(&op, 0);
            size_t len = strlen(path) + 1;
            if (len > PAGE) fail("the cell runner's path is longer than a page", NULL, 0);
            char timing[64];
            snprintf(timing, sizeof timing, "T%llu,%llu", (unsigned long long)started_ns, (unsigned long long)now_ns());
            exec_argv[n_argv++] = timing;
            exec_argv[n_argv] = NULL;
            void *page = mmap((void *)HANDOFF_ADDRESS, PAGE, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
            if (page != (void *)HANDOFF_ADDRESS) fail("mapping the handoff page", NULL, errno);
            memcpy(page, path, len);
            execve((const char *)HANDOFF_ADDRESS, exec_argv, environ); /* bwrap's environment, as Python's stage passes on */
            fail("execve of the cell runner", path, errno);
        }
        default: {
            char code[16];
            snprintf(code, sizeof code, "%u", op.code);
            fail("unknown op", code, 0);
        }
        }
    }
    fail("the plan ended without an exec", NULL, 0);
}
