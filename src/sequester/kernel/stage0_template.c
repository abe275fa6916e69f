/*
 * A view template's keeper: ``stage0 --template CONTROL_FD``.
 *
 * bwrap assembles a kernel's view (sequester/sandbox/template.py) once per policy and
 * execs this in it, as the namespace's pid 1. It then starts each kernel of that policy
 * as a child with fresh mount, PID, network, IPC and UTS namespaces (a copy of the view,
 * not a rebuild of it), which runs the host's plan like a first stage bwrap started
 * (run_plan) and execs the cell runner. No kernel sees another, the keeper, or a file
 * another can write:
 *
 * - Before it serves anything, the keeper makes every mount of the view read-only and
 *   checks that none stayed writable, so a kernel's only writable mounts are the ones its
 *   own plan makes (workspace, /dev/pts, /proc). Attack: a tmpfs of the view (bwrap's
 *   /var/tmp, /dev/shm, the assembled root) shared by every kernel of the template would
 *   be a channel between kernels of different users, or let one fill it for all.
 * - A kernel is in a PID namespace below the keeper's: the keeper is not in its /proc
 *   (its plan mounts its own), nor is any other kernel.
 * - A child keeps only the descriptors the host sent for it, at the numbers the host
 *   names: never the control socket.
 *
 * Protocol on CONTROL_FD (a stream socket; integers little-endian u32 unless said):
 *   keeper -> host, once: a kernel-protocol frame, {"op":"ready"} or {"op":"failed",...}.
 *   host -> keeper: MAGIC, n_fds, out_target (| REPORT_CLOSE_ON_EXEC), plan_len, with n_fds descriptors attached
 *     (SCM_RIGHTS): first the write end of a status pipe, then the kernel's; then n_fds
 *     target numbers (the first is ignored); then the plan (native_plan.encode_plan's body).
 *   keeper -> host: MAGIC, error (0 or an errno), the child's pid in the keeper's namespace,
 *     text_len, with the child's pidfd attached on success; then text_len bytes of reason.
 *   When a child ends, its raw wait status (native-endian int) is written to its status
 *   pipe, which is then closed. The keeper exits when the host closes CONTROL_FD; as its
 *   namespace's pid 1, it takes every kernel with it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <linux/mount.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "stage0.h"

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x1000
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

#define MAGIC 0x31545153u /* "SQT1" */
#define REPORT_CLOSE_ON_EXEC 0x80000000u /* in out_target: the plan's report descriptor closes at its exec */
#define MAX_FDS 16
#define MAX_CHILDREN 4096
#define MAX_MOUNTINFO (1u << 20)
#define KERNEL_NAMESPACES (CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)

struct child { pid_t pid; int status_fd; };
static struct child children[MAX_CHILDREN];
static int control = -1, child_signals = -1;

static void read_all(int fd, void *buf, size_t len) {
    unsigned char *p = buf;
    while (len > 0) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) _exit(n == 0 ? 0 : 71); /* the host went away (or broke the stream): done */
        p += n;
        len -= (size_t)n;
    }
}

static void reply(int error, pid_t pid, int pidfd, const char *text) {
    uint32_t head[4] = {MAGIC, (uint32_t)error, (uint32_t)pid, (uint32_t)strlen(text)};
    if (send_with_fd(control, head, sizeof head, text, pidfd) != 0) _exit(0); /* the host is gone */
}

/* mountinfo's octal escapes (\040 for a space, ...) undone in place. */
static void unescape(char *s) {
    char *out = s;
    for (; *s; s++) {
        if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' && s[3] >= '0' && s[3] <= '7') {
            *out++ = (char)((s[1] - '0') << 6 | (s[2] - '0') << 3 | (s[3] - '0'));
            s += 3;
        } else {
            *out++ = *s;
        }
    }
    *out = '\0';
}

struct mount_line { char *point; int writable; unsigned long flags; unsigned long id; };

/* /proc/self/mountinfo as (mount point, writable, per-mount flags), in mount order. */
static size_t read_mounts(char *buf, struct mount_line *out, size_t max) {
    int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("open /proc/self/mountinfo", NULL, errno);
    size_t len = 0;
    for (;;) {
        ssize_t n = read(fd, buf + len, MAX_MOUNTINFO - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail("read /proc/self/mountinfo", NULL, errno);
        if (n == 0) break;
        len += (size_t)n;
        if (len >= MAX_MOUNTINFO - 1) fail("the view has too many mounts", NULL, 0);
    }
    close(fd);
    buf[len] = '\0';
    size_t count = 0;
    for (char *line = buf, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        char *field[6] = {0}, *save = NULL, *tok = strtok_r(line, " ", &save);
        for (int i = 0; i < 6 && tok; i++, tok = strtok_r(NULL, " ", &save)) field[i] = tok;
        if (!field[5]) fail("a mountinfo line is malformed", NULL, 0);
        if (count == max) fail("the view has too many mounts", NULL, 0);
        unescape(field[4]);
        int writable = strncmp(field[5], "rw", 2) == 0 && (field[5][2] == ',' || field[5][2] == '\0');
        unsigned long flags = 0;
        char *save2 = NULL;
        for (char *o = strtok_r(field[5], ",", &save2); o; o = strtok_r(NULL, ",", &save2)) {
            if (!strcmp(o, "nosuid")) flags |= MS_NOSUID;
            else if (!strcmp(o, "nodev")) flags |= MS_NODEV;
            else if (!strcmp(o, "noexec")) flags |= MS_NOEXEC;
            else if (!strcmp(o, "noatime")) flags |= MS_NOATIME;
            else if (!strcmp(o, "nodiratime")) flags |= MS_NODIRATIME;
            else if (!strcmp(o, "relatime")) flags |= MS_RELATIME;
        }
        out[count++] = (struct mount_line){field[4], writable, flags, strtoul(field[0], NULL, 10)};
    }
    return count;
}

static struct mount_line lines[4096];
static unsigned long view_ids[4096]; /* the checked view's mounts, in order */
static size_t n_view_ids;
static char *mountinfo_buf;

/* Every mount of the view read-only, by the mount tree (mount_setattr, AT_RECURSIVE), not
 * by path: a mount below a folder the keeper may not enter (root's 0700 container storage
 * under an ordinary user's view) or below a hidden one has no path the keeper can remount
 * it by, and a folder that refuses the keeper may still let a kernel through (a root
 * caller's kernel is nobody: a 0701 folder of another user's group 0, red team). Only on a
 * Linux older than 5.12 (ENOSYS) mount by mount, by path; any mount that stays writable
 * then fails the view (a kernel gets a bwrap of its own instead). Then checked: no mount
 * of the view is writable. */
static void make_view_readonly(void) {
    char *buf = mountinfo_buf = malloc(MAX_MOUNTINFO);
    if (!buf) fail("out of memory", NULL, ENOMEM);
    size_t n;
    struct mount_attr ro = {.attr_set = MOUNT_ATTR_RDONLY};
    if (syscall(SYS_mount_setattr, AT_FDCWD, "/", AT_RECURSIVE, &ro, sizeof ro) != 0) {
        if (errno != ENOSYS) fail("making the view read-only", NULL, errno);
        n = read_mounts(buf, lines, 4096);
        for (size_t i = 0; i < n; i++)
            if (lines[i].writable &&
                mount(NULL, lines[i].point, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | lines[i].flags, NULL) != 0)
                fail("making the view read-only at", lines[i].point, errno);
    }
    n = read_mounts(buf, lines, 4096);
    for (size_t i = 0; i < n; i++) {
        if (lines[i].writable) fail("a mount of the view stayed writable:", lines[i].point, 0);
        view_ids[i] = lines[i].id;
    }
    n_view_ids = n;
}

/* The view is still the one checked. Attack (red team): a file the view covers (a
 * hidden file, an FFI library) replaced on the host by a rename takes its cover with it
 * in every namespace, so later kernels of the view would see the new file; bwrap would
 * have covered it again for the next kernel, and so does a new template. */
static int view_unchanged(void) {
    size_t n = read_mounts(mountinfo_buf, lines, 4096);
    if (n != n_view_ids) return 0;
    for (size_t i = 0; i < n; i++)
        if (lines[i].id != view_ids[i]) return 0;
    return 1;
}

static void __attribute__((noreturn)) start_child(int *fds, const uint32_t *targets, uint32_t nfds,
                                                  uint32_t out_target, const unsigned char *plan, uint32_t len) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    /* Dies with the keeper (and so with the host), whatever uid it ends as. */
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    close(control);
    close(child_signals);
    close(fds[0]); /* the keeper's end of this child's status pipe */
    int floor = 3;
    for (uint32_t i = 1; i < nfds; i++) {
        if ((int)targets[i] >= floor) floor = (int)targets[i] + 1;
        if (fds[i] >= floor) floor = fds[i] + 1;
    }
    for (uint32_t i = 1; i < nfds; i++) { /* out of the way of every target first */
        int moved = fcntl(fds[i], F_DUPFD_CLOEXEC, floor);
        if (moved < 0) fail("moving a descriptor", NULL, errno);
        close(fds[i]);
        fds[i] = moved;
    }
    for (uint32_t i = 1; i < nfds; i++) {
        if (dup2(fds[i], (int)targets[i]) < 0) fail("placing a descriptor", NULL, errno);
        close(fds[i]);
    }
    /* Nothing else stays open: close every gap between the targets, then the rest. */
    unsigned int low = 3;
    for (;;) {
        unsigned int next = ~0u;
        for (uint32_t i = 1; i < nfds; i++)
            if (targets[i] >= low && targets[i] < next) next = targets[i];
        if (next == ~0u) break;
        if (next > low) syscall(SYS_close_range, low, next - 1, 0);
        low = next + 1;
    }
    syscall(SYS_close_range, low, ~0u, 0);
    out_fd = (int)(out_target & ~REPORT_CLOSE_ON_EXEC);
    /* A command's report descriptor ends at its exec: the command never holds it. */
    if ((out_target & REPORT_CLOSE_ON_EXEC) && fcntl(out_fd, F_SETFD, FD_CLOEXEC) != 0) fail("fcntl", NULL, errno);
    /* A session (and process group) of its own. Attack (red team): the keeper's clones
     * shared its process group, and a signal from outside a PID namespace reaches its
     * pid 1 like an ancestor's, so kill(0, SIGKILL) or SIGSTOP in one kernel killed or
     * froze every kernel of the view, and setpriority(PRIO_PGRP) reniced them all. */
    if (setsid() < 0) fail("setsid", NULL, errno);
    started_ns = now_ns();
    run_plan(plan, len);
}

static void serve_request(void) {
    uint32_t head[4];
    int fds[MAX_FDS];
    size_t nfds = 0;
    char space[CMSG_SPACE(sizeof(int) * MAX_FDS)];
    struct iovec iov = {head, sizeof head};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = space, .msg_controllen = sizeof space};
    ssize_t got;
    while ((got = recvmsg(control, &msg, MSG_CMSG_CLOEXEC)) < 0)
        if (errno != EINTR) _exit(71);
    if (got == 0) _exit(0); /* the host closed the template */
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < k && nfds < MAX_FDS; i++) memcpy(&fds[nfds++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        }
    if ((size_t)got < sizeof head) read_all(control, (unsigned char *)head + got, sizeof head - (size_t)got);
    /* The host is trusted; a stream it broke cannot be resynchronised: stop. */
    if (head[0] != MAGIC || head[1] != nfds || nfds < 1 || head[3] > MAX_FRAME || (msg.msg_flags & MSG_CTRUNC)) _exit(71);
    uint32_t targets[MAX_FDS];
    read_all(control, targets, nfds * sizeof(uint32_t));
    unsigned char *plan = malloc(head[3] ? head[3] : 1);
    if (!plan) _exit(71);
    read_all(control, plan, head[3]);
    if (!view_unchanged()) { /* nothing is started from it any more: the host makes a new view */
        free(plan);
        for (size_t i = 0; i < nfds; i++) close(fds[i]);
        reply(ESTALE, 0, -1, "the view changed on the host (a file it covers was replaced)");
        return;
    }
    size_t slot = 0;
    while (slot < MAX_CHILDREN && children[slot].pid != 0) slot++;
    int pidfd = -1;
    long pid = slot == MAX_CHILDREN ? (errno = EAGAIN, -1)
                                    : syscall(SYS_clone, KERNEL_NAMESPACES | CLONE_PIDFD | SIGCHLD, NULL, &pidfd, NULL, 0);
    if (pid == 0) start_child(fds, targets, (uint32_t)nfds, head[2], plan, head[3]);
    int err = errno;
    free(plan);
    for (size_t i = 1; i < nfds; i++) close(fds[i]);
    if (pid < 0) {
        close(fds[0]);
        reply(err, 0, -1, slot == MAX_CHILDREN ? "the template has too many kernels" : "clone of a kernel failed");
        return;
    }
    children[slot] = (struct child){(pid_t)pid, fds[0]};
    reply(0, (pid_t)pid, pidfd, "");
    close(pidfd);
}

static void reap_children(void) {
    struct signalfd_siginfo info;
    while (read(child_signals, &info, sizeof info) > 0) {}
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
        for (size_t i = 0; i < MAX_CHILDREN; i++)
            if (children[i].pid == pid) {
                write_all(children[i].status_fd, (const char *)&status, sizeof status);
                close(children[i].status_fd);
                children[i] = (struct child){0, -1};
                break;
            }
}

int template_main(int fd) {
    control = out_fd = fd; /* until ready, a failure is told to the host as a frame */
    /* Nothing bwrap left open stays (its block pipe, say): the keeper holds its control
     * socket, stdio and the SIGCHLD descriptor made below, and nothing else. */
    if (control > 3) syscall(SYS_close_range, 3, (unsigned)control - 1, 0);
    syscall(SYS_close_range, (unsigned)control + 1, ~0u, 0);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &chld, NULL) != 0) fail("blocking SIGCHLD", NULL, errno);
    child_signals = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (child_signals < 0) fail("signalfd", NULL, errno);
    if (fcntl(control, F_SETFD, FD_CLOEXEC) != 0) fail("fcntl", NULL, errno);
    make_view_readonly();
    static const char ready[] = "{\"op\":\"ready\"}";
    unsigned char header[4] = {0, 0, 0, sizeof ready - 1};
    write_all(control, (const char *)header, 4);
    write_all(control, ready, sizeof ready - 1);
    out_fd = -1;
    struct pollfd watch[2] = {{control, POLLIN, 0}, {child_signals, POLLIN, 0}};
    for (;;) {
        if (poll(watch, 2, -1) < 0) {
            if (errno == EINTR) continue;
            _exit(71);
        }
        if (watch[1].revents) reap_children();
        if (watch[0].revents) serve_request();
    }
}
