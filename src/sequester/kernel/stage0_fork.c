/*
 * A warm kernel's forks: the Python extension ``_sequester_fork`` (sequester/kernel/fork.py).
 *
 * A warm kernel ran its init cell (imports, loaded data) once; each fork is a
 * copy-on-write copy of that process with namespaces, workspace, network and ids of its
 * own, confined by the host's plan (native_plan.plan_fork) before any Python runs in it:
 *
 *   warm kernel:  recvmsg the request (descriptors, plan) from the host's fork channel,
 *                 fork()  -> an intermediate, single-threaded
 *   intermediate: clone(fork()'s flags | user, mount, PID, network, IPC, UTS) -> the fork,
 *                 the fork's pidfd to the host on the channel, _exit
 *   fork:         a session of its own, the plan (its /proc, ids, workspace, loopback,
 *                 limits, no capabilities, the write lock, the kernel's seccomp filter
 *                 stacked on the warm kernel's), its descriptors placed (every other one
 *                 the warm kernel had becomes /dev/null: a pipe, socket or file it left
 *                 open would be a channel between forks), every shared mapping made a
 *                 private copy (the same: a MAP_SHARED page written by one fork would be
 *                 read by the next), then Python's after-fork handlers, and back to the
 *                 cell runner as a kernel of its own.
 *
 * glibc's fork() first, not one clone() with namespace flags: the warm kernel may have
 * threads (its network bridge, a library's workers), and only fork() takes the C
 * library's locks (malloc's) first, so the copy never inherits one held; the copy is
 * single-threaded, so its raw clone is safe. The warm kernel's seccomp filter lets
 * through clone with exactly fork()'s flags, alone or with namespace flags, and no
 * unshare (guard/seccomp.py, profile "warm": Python's os.fork cannot ask for a
 * namespace, so init cannot take a user namespace and its capabilities); a fork's
 * filter refuses both.
 *
 * It decides nothing: the plan comes from the host on the channel, read here, never by
 * Python; the channel must be the socket prepare() was given before any cell ran (the
 * warm kernel cannot make another: its filter allows TCP sockets only).
 *
 * Channel protocol (integers little-endian u32):
 *   host -> warm kernel: MAGIC, n_fds, plan_len, nonce, with n_fds descriptors (SCM_RIGHTS); then
 *     n_fds targets (0xffffffff: the lowest number the warm kernel did not have open,
 *     reported back to Python); then the plan (native_plan.encode_plan's body, ending in
 *     RETURN). The descriptor at index OUT_INDEX is where the fork reports a failure.
 *   -> host: MAGIC, error (0 or an errno), the fork's pid in the warm kernel's namespace,
 *     text_len, nonce (the request's: a late answer is never taken for the next), with the
 *     fork's pidfd attached on success; then text_len bytes of reason.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "stage0.h"

#define FORK_MAGIC 0x31465153u /* "SQF1" */
#define FRESH 0xffffffffu
#define MAX_FDS 16
#define OUT_INDEX 1 /* the fork's from-kernel pipe: where a failed plan is told */
#define FORK_NAMESPACES (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
/* glibc's fork(): CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD (with no tid address here: unused) */
#define FORK_CLONE_FLAGS 0x01200011UL
#define MAX_MAPS (4u << 20)
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static dev_t channel_dev;
static ino_t channel_ino;
static int prepared;

static int read_whole(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void reply(int channel, uint32_t nonce, int error, pid_t pid, int pidfd, const char *text) {
    uint32_t head[5] = {FORK_MAGIC, (uint32_t)error, (uint32_t)pid, (uint32_t)strlen(text), nonce};
    send_with_fd(channel, head, sizeof head, text, pidfd); /* (a host that is gone hears nothing) */
}

struct request {
    uint32_t nonce;
    int fds[MAX_FDS];
    uint32_t targets[MAX_FDS];
    uint32_t nfds;
    unsigned char *plan;
    uint32_t plan_len;
};

static void drop_request(struct request *r) {
    for (uint32_t i = 0; i < r->nfds; i++) close(r->fds[i]);
    r->nfds = 0;
    free(r->plan);
    r->plan = NULL;
}

/* 0, or an errno with the request dropped. */
static int receive(int channel, struct request *r) {
    uint32_t head[4];
    char space[CMSG_SPACE(sizeof(int) * MAX_FDS)];
    struct iovec iov = {head, sizeof head};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = space, .msg_controllen = sizeof space};
    ssize_t got;
    memset(r, 0, sizeof *r);
    while ((got = recvmsg(channel, &msg, MSG_CMSG_CLOEXEC)) < 0)
        if (errno != EINTR) return errno;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
                if (r->nfds < MAX_FDS) r->fds[r->nfds++] = fd;
                else close(fd);
            }
        }
    if (got == 0) { drop_request(r); return EPIPE; }
    if ((size_t)got < sizeof head && read_whole(channel, (char *)head + got, sizeof head - (size_t)got) != 0) {
        drop_request(r);
        return EPIPE;
    }
    if (head[0] != FORK_MAGIC || head[1] != r->nfds || r->nfds <= OUT_INDEX || head[2] > MAX_FRAME ||
        (msg.msg_flags & MSG_CTRUNC)) {
        drop_request(r);
        return EPROTO;
    }
    r->plan_len = head[2];
    r->nonce = head[3];
    r->plan = malloc(r->plan_len ? r->plan_len : 1);
    if (!r->plan || read_whole(channel, r->targets, r->nfds * sizeof(uint32_t)) != 0 ||
        read_whole(channel, r->plan, r->plan_len) != 0) {
        drop_request(r);
        return EPROTO;
    }
    return 0;
}

static int is_target(const struct request *r, int fd) {
    for (uint32_t i = 0; i < r->nfds; i++)
        if ((int)r->targets[i] == fd) return 1;
    return 0;
}

/* Which numbers are open in this process, but the request's own: in the fork, after the
 * fork (single-threaded: a snapshot taken in the warm kernel before it would miss what
 * another of its threads opened meanwhile, red team). One poll per 1,024 numbers:
 * POLLNVAL is closed. */
static unsigned char *open_numbers(const struct request *r, int limit) {
    unsigned char *was_open = calloc((size_t)limit, 1);
    if (!was_open) fail("out of memory", NULL, ENOMEM);
    struct pollfd batch[1024];
    for (int base = 0; base < limit; base += 1024) {
        int n = limit - base < 1024 ? limit - base : 1024;
        for (int i = 0; i < n; i++) batch[i] = (struct pollfd){base + i, 0, 0};
        while (poll(batch, (nfds_t)n, 0) < 0)
            if (errno != EINTR) fail("poll of the descriptor table", NULL, errno);
        for (int i = 0; i < n; i++) {
            int received = 0;
            for (uint32_t k = 0; k < r->nfds; k++) received |= r->fds[k] == base + i;
            if (!received && !(batch[i].revents & POLLNVAL)) was_open[base + i] = 1;
        }
    }
    return was_open;
}

/* The lowest descriptor number not open in the warm kernel (nor a target): the ones it
 * had stay taken by /dev/null in the fork, so nothing of its Python that still names one
 * (a file object init left) can close the fork's. */
static int fresh_number(const struct request *r, const unsigned char *was_open, int limit, int from) {
    for (int fd = from; fd < limit; fd++)
        if (!was_open[fd] && !is_target(r, fd)) return fd;
    fail("no descriptor number is free for a fork", NULL, EMFILE);
}

/* The fork's descriptors at their numbers, every other one it inherited /dev/null. */
static void place_descriptors(struct request *r, const unsigned char *was_open, int limit, int *placed) {
    int next_fresh = 3, floor = 3;
    for (uint32_t i = 0; i < r->nfds; i++) {
        if (r->targets[i] == FRESH) {
            next_fresh = fresh_number(r, was_open, limit, next_fresh);
            r->targets[i] = (uint32_t)next_fresh++;
        }
        if (r->targets[i] >= (uint32_t)limit) fail("a fork's descriptor number is over the limit", NULL, EBADF);
        placed[i] = (int)r->targets[i];
        if ((int)r->targets[i] >= floor) floor = (int)r->targets[i] + 1;
    }
    for (int fd = limit - 1; fd >= floor; fd--)
        if (was_open[fd]) { floor = fd + 1; break; }
    if (floor + MAX_FDS + 1 >= limit) fail("no descriptor numbers are free for a fork", NULL, EMFILE);
    for (uint32_t i = 0; i < r->nfds; i++) { /* out of the way of every target first */
        int moved = fcntl(r->fds[i], F_DUPFD_CLOEXEC, floor);
        if (moved < 0) fail("moving a descriptor", NULL, errno);
        close(r->fds[i]);
        r->fds[i] = moved;
    }
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0) fail("open", "/dev/null", errno);
    for (int fd = 0; fd < limit; fd++)
        if (was_open[fd] && !is_target(r, fd) && fd != null && dup2(null, fd) < 0) fail("dup2 /dev/null", NULL, errno);
    for (uint32_t i = 0; i < r->nfds; i++) {
        if (dup2(r->fds[i], (int)r->targets[i]) < 0) fail("placing a descriptor", NULL, errno);
        close(r->fds[i]);
    }
    if (!was_open[null] && !is_target(r, null)) close(null);
    /* Anything above the table the warm kernel had (the moved copies are closed) */
    syscall(SYS_close_range, (unsigned)floor, ~0u, 0);
}

/* Every MAP_SHARED mapping made a private copy of itself, at the same address with the
 * same protection. */
static void privatise_shared_mappings(void) {
    char *buf = malloc(MAX_MAPS);
    if (!buf) fail("out of memory", NULL, ENOMEM);
    int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("open", "/proc/self/maps", errno);
    size_t len = 0;
    for (;;) {
        ssize_t n = read(fd, buf + len, MAX_MAPS - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail("read", "/proc/self/maps", errno);
        if (n == 0) break;
        len += (size_t)n;
        if (len >= MAX_MAPS - 1) fail("the warm kernel has too many mappings", NULL, 0);
    }
    close(fd);
    buf[len] = '\0';
    for (char *line = buf, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        unsigned long start, end;
        char perms[8] = {0};
        if (sscanf(line, "%lx-%lx %7s", &start, &end, perms) != 3) fail("a maps line is malformed", NULL, 0);
        if (perms[3] != 's') continue;
        size_t size = end - start;
        int prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) |
                   (perms[2] == 'x' ? PROT_EXEC : 0);
        void *copy = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (copy == MAP_FAILED) fail("copying a shared mapping", NULL, errno);
        int readable = (prot & PROT_READ) || mprotect((void *)start, size, prot | PROT_READ) == 0;
        if (readable) memcpy(copy, (void *)start, size); /* else: its pages cannot be read: zeros */
        void *at = mmap((void *)start, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (at != (void *)start) fail("replacing a shared mapping", NULL, errno);
        memcpy(at, copy, size);
        if (mprotect(at, size, prot) != 0) fail("mprotect of a private copy", NULL, errno);
        munmap(copy, size);
    }
    free(buf);
}

/* Returns in the fork only. */
static void intermediate(int channel, struct request *r) {
    long pid = syscall(SYS_clone, FORK_CLONE_FLAGS | FORK_NAMESPACES, NULL, NULL, NULL, 0);
    if (pid == 0) return; /* the fork: back to sq_fork */
    if (pid < 0) {
        reply(channel, r->nonce, errno, 0, -1, "clone of the fork (its namespaces) failed");
        _exit(0);
    }
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
    if (pidfd < 0) {
        int err = errno;
        kill((pid_t)pid, SIGKILL);
        reply(channel, r->nonce, err, 0, -1, "pidfd_open of the fork failed");
        _exit(0);
    }
    reply(channel, r->nonce, 0, (pid_t)pid, pidfd, "");
    _exit(0);
}

static PyObject *sq_prepare(PyObject *self, PyObject *args) {
    int channel;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &channel)) return NULL;
    struct stat st;
    if (prepared) return PyErr_Format(PyExc_RuntimeError, "the fork channel is already set");
    if (fstat(channel, &st) != 0 || !S_ISSOCK(st.st_mode))
        return PyErr_Format(PyExc_OSError, "the fork channel is not a socket");
    channel_dev = st.st_dev;
    channel_ino = st.st_ino;
    prepared = 1;
    Py_RETURN_NONE;
}

static PyObject *sq_fork(PyObject *self, PyObject *args) {
    int channel;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &channel)) return NULL;
    struct stat st;
    if (!prepared || fstat(channel, &st) != 0 || st.st_dev != channel_dev || st.st_ino != channel_ino)
        return PyErr_Format(PyExc_PermissionError, "not the fork channel this warm kernel was given");
    /* Python's before-fork handlers run first: no Python runs between taking the host's
     * descriptors and the fork, nor in the warm kernel while it still holds them (red
     * team: an os.register_at_fork handler dup2'ed files of its own onto the received
     * numbers, so two forks shared a descriptor). */
    PyOS_BeforeFork();
    struct request r;
    int err = receive(channel, &r);
    if (err) {
        PyOS_AfterFork_Parent();
        reply(channel, 0, err, 0, -1, "the fork request was malformed");
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int limit = (int)sysconf(_SC_OPEN_MAX);
    if (limit <= 0 || limit > (1 << 20)) limit = 1 << 20;
    pid_t pid = fork();
    if (pid == 0) {
        intermediate(channel, &r); /* returns in the fork only */
        uint64_t begun = now_ns();
        setsid(); /* kill(0, ...) and setpriority(PRIO_PGRP) reach none but itself */
        out_fd = r.fds[OUT_INDEX];
        started_ns = begun;
        run_plan_returning(r.plan, r.plan_len);
        unsigned char *was_open = open_numbers(&r, limit);
        int placed[MAX_FDS];
        place_descriptors(&r, was_open, limit, placed);
        out_fd = placed[OUT_INDEX];
        privatise_shared_mappings();
        free(was_open);
        free(r.plan);
        PyOS_AfterFork_Child();
        PyObject *numbers = PyList_New(0);
        if (!numbers) return NULL;
        for (uint32_t i = 0; i < r.nfds; i++) {
            PyObject *n = PyLong_FromLong(placed[i]);
            if (!n || PyList_Append(numbers, n) != 0) return NULL;
            Py_DECREF(n);
        }
        return Py_BuildValue("(NKKk)", numbers, (unsigned long long)begun, (unsigned long long)now_ns(),
                             (unsigned long)r.nonce);
    }
    err = errno;
    uint32_t nonce = r.nonce;
    drop_request(&r); /* closed before any Python of the warm kernel runs again */
    PyOS_AfterFork_Parent();
    if (pid < 0) {
        reply(channel, nonce, err, 0, -1, "fork of the warm kernel failed");
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* The intermediate exits at once (SIGCHLD ignored: no status, ECHILD). */
    Py_BEGIN_ALLOW_THREADS
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"prepare", sq_prepare, METH_VARARGS, "prepare(channel_fd): the host's fork channel, before any cell runs."},
    {"fork", sq_fork, METH_VARARGS,
     "fork(channel_fd): None in the warm kernel; in the fork, (descriptor numbers, start ns, confined ns)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sequester_fork", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sequester_fork(void) { return PyModule_Create(&module); }
