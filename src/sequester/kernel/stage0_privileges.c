/*
 * The native first stage's privilege steps (run_plan's DROP_BOUNDING, CLEAR_CAPS,
 * CHECK_NO_CAPS, LANDLOCK, SECCOMP): see stage0.c.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "stage0.h"

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

void drop_bounding_set(void) {
    char buf[32] = {0};
    int fd = open_path("/proc/sys/kernel/cap_last_cap", O_RDONLY | O_CLOEXEC);
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

void clear_capabilities(void) {
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    check((int)syscall(SYS_capset, &header, data), "capset", NULL);
    check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities", NULL);
}

/* Every capability set of /proc/self/status must read zero. */
void check_no_capabilities(void) {
    char buf[8192];
    int fd = open_path("/proc/self/status", O_RDONLY | O_CLOEXEC);
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
void landlock_writes(uint64_t handled, char *const *paths, uint32_t count) {
    long ruleset = syscall(SYS_LANDLOCK_CREATE_RULESET, &handled, sizeof handled, 0);
    if (ruleset < 0) fail("landlock_create_ruleset", NULL, errno);
    for (uint32_t i = 0; i < count; i++) {
        const char *path = paths[i];
        if (!path) fail("an op has a NULL where text is needed", NULL, 0);
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

void load_seccomp(const char *program, size_t len) {
    if (len == 0 || len % sizeof(struct sock_filter) || len / sizeof(struct sock_filter) > 0xffff)
        fail("the seccomp program is not a whole number of instructions", NULL, 0);
    struct sock_fprog prog = {(unsigned short)(len / sizeof(struct sock_filter)), (struct sock_filter *)program};
    long r = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog);
    if (r != 0) fail("seccomp(SET_MODE_FILTER)", NULL, r > 0 ? EAGAIN : errno);
}

