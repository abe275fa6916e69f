"""Code that runs inside the kernel process to confine it: seccomp, audit hook, Landlock, privileges."""
