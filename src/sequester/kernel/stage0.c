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
 *
 * Usage: stage0 --template CONTROL_FD keeps a view for many kernels instead (see
 * stage0_template.c): each one is a child that runs its plan with run_plan below.
 * The privilege steps are in stage0_privileges.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
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
#include <linux/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "stage0.h"

extern char **environ;

#define HANDOFF_ADDRESS 0x300000000000UL
#define PAGE 4096
#define MAX_ARGS 64
#define MAX_EXEC 4096
#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

/* native_plan.Op's numbers (6 is unused). */
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif

enum {
    OP_UNSHARE = 1, OP_MOUNT = 2, OP_UMOUNT = 3, OP_MKDIR = 4, OP_MKDIR_MISSING = 5, OP_CHDIR = 7,
    OP_LOOPBACK_UP = 8, OP_WRITE = 9, OP_RLIMIT = 10, OP_CHOWN = 11, OP_DROP_BOUNDING = 12, OP_SETIDS = 13,
    OP_CLEAR_CAPS = 14, OP_CHECK_NO_CAPS = 15, OP_NO_NEW_PRIVS = 16, OP_SECCOMP = 17, OP_ARG = 18, OP_EXEC = 19,
    OP_MOUNTPOINT = 20, OP_LANDLOCK = 21, OP_USERNS = 22, OP_SETATTR = 23, OP_RETURN = 24, OP_FORK_IDS = 25,
    OP_COVER_PROC = 26,
};

int out_fd = -1;
uint64_t started_ns;
int proc_root_fd = -1;

/* A path below /proc: through the /proc kept open when the plan covered it (COVER_PROC). */
int open_path(const char *path, int flags) {
    if (proc_root_fd >= 0 && strncmp(path, "/proc/", 6) == 0) return openat(proc_root_fd, path + 6, flags);
    return open(path, flags);
}

uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        buf += n;
        len -= (size_t)n;
    }
}

int send_with_fd(int sock, const void *head, size_t head_len, const char *text, int fd) {
    struct iovec iov[2] = {{(void *)head, head_len}, {(void *)text, strlen(text)}};
    char space[CMSG_SPACE(sizeof(int))];
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = 2};
    if (fd >= 0) {
        memset(space, 0, sizeof space);
        msg.msg_control = space;
        msg.msg_controllen = sizeof space;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    while (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0)
        if (errno != EINTR) return -1;
    return 0;
}

/* The kernel protocol's {"op": "failed", "error": ...}; the text is JSON-escaped, and
 * bytes outside printable ASCII become '?' (the host parses this as untrusted). */
void fail(const char *what, const char *detail, int err) {
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

#ifndef STAGE0_LIBRARY
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
#endif

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

void check(int result, const char *what, const char *detail) {
    if (result != 0) fail(what, detail, errno);
}

/* mkdir, then chmod: the mode is not narrowed by the umask. */
static void make_dir(const char *path, mode_t mode) {
    check(mkdir(path, mode), "mkdir", path);
    check(chmod(path, mode), "chmod", path);
}

static void loopback_up(void) {
    /* A stream socket: a fork runs this under its warm kernel's filter, which allows no other. */
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) fail("socket for loopback", NULL, errno);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    ifr.ifr_flags = IFF_UP;
    check(ioctl(s, SIOCSIFFLAGS, &ifr), "bringing up loopback", NULL);
    close(s);
}

static void write_file(const char *path, const char *data, size_t len) {
    int fd = open_path(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
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

/* USERNS inside_uid inside_gid: a user namespace of this process's own (a kernel started
 * from a view template, sequester/sandbox/template.py), so its processes count against its
 * own RLIMIT_NPROC, not against every kernel of the view. The ids it has now (the only
 * ones it may map without privileges over the template's namespace) appear inside as the
 * given ones: no id changes, and the capabilities it gets are its own namespace's. It is
 * dumpable for the writes (a root caller's kernel lost that with its uid), then as it was.
 * Every mount is made before: the mount and network namespaces stay the template's user
 * namespace's, over which the process then holds no capability. */
static void map_ids(unsigned long long inside_uid, unsigned long long inside_gid, unsigned long long uid,
                    unsigned long long gid, int new_namespace) {
    int dumpable = prctl(PR_GET_DUMPABLE, 0, 0, 0, 0);
    check(prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)", NULL);
    if (new_namespace) check(unshare(CLONE_NEWUSER), "unshare(user)", NULL);
    char map[64];
    int n = snprintf(map, sizeof map, "%llu %llu 1\n", inside_uid, uid);
    write_file("/proc/self/uid_map", map, (size_t)n);
    write_file("/proc/self/setgroups", "deny", 4);
    n = snprintf(map, sizeof map, "%llu %llu 1\n", inside_gid, gid);
    write_file("/proc/self/gid_map", map, (size_t)n);
    if (dumpable != 1) check(prctl(PR_SET_DUMPABLE, dumpable < 0 ? 0 : dumpable, 0, 0, 0), "prctl(PR_SET_DUMPABLE)", NULL);
}

static void own_user_namespace(unsigned long long inside_uid, unsigned long long inside_gid) {
    map_ids(inside_uid, inside_gid, geteuid(), getegid(), 1);
}

/* COVER_PROC: a warm kernel's (sequester/kernel/fork.py). Landlock would forbid its forks
 * every mount, so the warm kernel has none, and instead no /proc at all: an empty
 * read-only tmpfs covers it (no /proc/<tid>/mem to write its own code through; the
 * plan's later steps reach /proc through a descriptor kept to it). A fork mounts a /proc
 * of its own PID namespace, which the kernel allows a user namespace only beside a /proc
 * mount with nothing mounted on it: one is kept at /run/p/proc, below a folder of mode
 * 0 on a read-only tmpfs, out of the warm kernel's reach. */
static void cover_proc(void) {
    const unsigned long flags = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    check(mount("tmpfs", "/run", "tmpfs", flags, "size=16k,mode=755"), "mount", "/run");
    make_dir("/run/p", 0755);
    make_dir("/run/p/proc", 0555);
    check(mount("proc", "/run/p/proc", "proc", flags, NULL), "mount", "/run/p/proc");
    check(chmod("/run/p", 0), "chmod", "/run/p");
    check(mount(NULL, "/run", NULL, MS_REMOUNT | MS_RDONLY | flags, NULL), "remount read-only", "/run");
    proc_root_fd = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (proc_root_fd < 0) fail("open", "/proc", errno);
    check(mount("tmpfs", "/proc", "tmpfs", flags | MS_RDONLY, "size=4k,mode=555"), "mount", "/proc");
}

/* 1: the plan reached RETURN; 0: it ended without one (an EXEC never returns). */
static int execute_plan(const unsigned char *frame, uint32_t size) {
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
            landlock_writes(int_arg(&op, 0), op.argv + 1, op.argc ? op.argc - 1 : 0);
            break;
        case OP_USERNS:
            own_user_namespace(int_arg(&op, 0), int_arg(&op, 1));
            break;
        case OP_FORK_IDS: /* inside_uid inside_gid: the namespace a fork was born in shows it as its parent */
            map_ids(int_arg(&op, 0), int_arg(&op, 1), int_arg(&op, 0), int_arg(&op, 1), 0);
            break;
        case OP_COVER_PROC:
            cover_proc();
            break;
        case OP_RETURN:
            return 1;
        case OP_SETATTR: { /* path recursive set clear [required]: mount_setattr by the mount tree */
            struct mount_attr attr = {.attr_set = int_arg(&op, 2), .attr_clr = int_arg(&op, 3)};
            /* Older than 5.12 (ENOSYS): bwrap's remounts stand, unless the plan requires it
             * (a fork's: nothing else makes what it copied read-only). */
            if (syscall(SYS_mount_setattr, AT_FDCWD, text_arg(&op, 0), int_arg(&op, 1) ? AT_RECURSIVE : 0, &attr,
                        sizeof attr) != 0 && (errno != ENOSYS || (op.argc > 4 && int_arg(&op, 4))))
                fail("mount_setattr", text_arg(&op, 0), errno);
            break;
        }
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
            /* A kernel's runner gets the stage's timing as its last argument; a command
             * (EXEC path 0) gets exactly its own arguments. */
            char timing[64];
            snprintf(timing, sizeof timing, "T%llu,%llu", (unsigned long long)started_ns, (unsigned long long)now_ns());
            if (op.argc < 2 || int_arg(&op, 1)) exec_argv[n_argv++] = timing;
            exec_argv[n_argv] = NULL;
            void *page = mmap((void *)HANDOFF_ADDRESS, PAGE, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
            if (page != (void *)HANDOFF_ADDRESS) fail("mapping the handoff page", NULL, errno);
            memcpy(page, path, len);
            execve((const char *)HANDOFF_ADDRESS, exec_argv, environ); /* bwrap's environment, as Python's stage passes on */
            fail("execve of", path, errno); /* the cell runner, or run_confined's program */
        }
        default: {
            char code[16];
            snprintf(code, sizeof code, "%u", op.code);
            fail("unknown op", code, 0);
        }
        }
    }
    return 0;
}

void run_plan(const unsigned char *frame, uint32_t size) {
    if (execute_plan(frame, size)) fail("the plan returned where it must exec", NULL, 0);
    fail("the plan ended without an exec", NULL, 0);
}

void run_plan_returning(const unsigned char *frame, uint32_t size) {
    if (!execute_plan(frame, size)) fail("the plan ended without a RETURN", NULL, 0);
}

#ifndef STAGE0_LIBRARY
int main(int argc, char **argv) {
    started_ns = now_ns();
    if (argc == 3 && strcmp(argv[1], "--template") == 0) return template_main(atoi(argv[2]));
    if (argc != 3) {
        static const char usage[] = "usage: stage0 IN_FD OUT_FD | stage0 --template CONTROL_FD (sequester's kernel first stage)\n";
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
    run_plan(frame, size);
}
#endif
