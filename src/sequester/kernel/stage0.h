/* What stage0.c (the plan executor) and stage0_template.c (a view template's keeper)
 * share. */
#ifndef SEQUESTER_STAGE0_H
#define SEQUESTER_STAGE0_H
#include <stddef.h>
#include <stdint.h>

#define MAX_FRAME (4u << 20) /* a plan's size limit (native_plan.MAX_PLAN) */

extern int out_fd;         /* where fail() reports, as the kernel protocol's "failed" message */
extern uint64_t started_ns; /* CLOCK_MONOTONIC when this kernel's first stage began */

extern int proc_root_fd;   /* /proc, kept open when the plan covers it (a warm kernel) */

uint64_t now_ns(void);
/* open(2), but a path below /proc goes through proc_root_fd when the plan covered /proc. */
int open_path(const char *path, int flags);
void write_all(int fd, const char *buf, size_t len);
/* One message of head_len bytes of head, then text, with fd attached (SCM_RIGHTS) unless
 * it is negative; 0, or -1 when the socket refused it (EINTR retried). */
int send_with_fd(int sock, const void *head, size_t head_len, const char *text, int fd);
void __attribute__((noreturn)) fail(const char *what, const char *detail, int err);
/* fail() unless result is 0, with errno. */
void check(int result, const char *what, const char *detail);
/* Runs a plan (native_plan.encode_plan's body) to its EXEC; fails closed otherwise. */
void __attribute__((noreturn)) run_plan(const unsigned char *frame, uint32_t size);
/* Runs a plan that ends in RETURN (a fork of a warm kernel, stage0_fork.c); fails closed otherwise. */
void run_plan_returning(const unsigned char *frame, uint32_t size);
/* stage0_privileges.c: the plan's privilege steps. */
void drop_bounding_set(void);
void clear_capabilities(void);
void check_no_capabilities(void);
/* handled: the rights the ruleset restricts; paths: where they stay allowed. */
void landlock_writes(uint64_t handled, char *const *paths, uint32_t count);
void load_seccomp(const char *program, size_t len);
/* stage0 --template CONTROL_FD: serve kernels from this view (stage0_template.c). */
int template_main(int control);
#endif
