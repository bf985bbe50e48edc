/* spawn_confined: start a program by vfork and exec, confined in the child
 * before its exec: the fork server's launch of a session's network stack
 * (dispatchd/worker/stackstart.py).
 *
 * Why: the fork server is a Python process of about 20 MiB. A fork of it
 * copies its page tables (1-1.5 ms here), its child then copies every page
 * it writes while it confines itself in Python, and the exec throws all of
 * that away; a network-on session paid it once for its stack. vfork shares
 * the caller's memory until the exec: nothing is copied.
 *
 * What the child does, in this order, each step a system call on what the
 * caller prepared (the same steps, in the same order, as the fork path of
 * stackstart.py and stacks.confine_stack):
 * - every signal back to its default, those ignored too (Python ignores
 *   SIGPIPE and SIGXFSZ, the fork server SIGINT): a stack finds its signals
 *   as a new process would (pasta refuses to start otherwise);
 * - killed with its parent (PR_SET_PDEATHSIG), and gone at once if that
 *   parent already is;
 * - into the session's cgroup (``cgroup_procs_fd``, its cgroup.procs opened
 *   for writing), before anything else runs;
 * - its stdio, and of the caller's descriptors only ``keep`` (made
 *   inheritable), every other one closed;
 * - its resource limits (soft = hard), no_new_privs, the Landlock ruleset
 *   (``ruleset_fd``, complete: built by the caller) restricting it, then the
 *   seccomp program (classic BPF, compiled by the caller), the last step
 *   before the exec, which the program must allow.
 * A step that fails ends the child before the exec: the caller learns which
 * step and its errno through a close-on-exec pipe, reaps the child and
 * raises OSError(errno, strerror, step). No program runs unconfined.
 *
 * Safety (between vfork and exec, in the caller's memory), as _spawn.c: the
 * child only makes system calls on data built before the vfork, allocates
 * nothing, writes no memory of the caller's, and never returns; every signal
 * is blocked across the vfork, and the child resets every handler before it
 * unblocks them. The child's signal handlers, limits, credentials
 * (no_new_privs, Landlock), seccomp filter and descriptor table are its own
 * (no CLONE_THREAD, CLONE_SIGHAND or CLONE_FILES): none of it reaches the
 * caller.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "_lines.h"

#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif

#define MAX_KEEP 16
#define MAX_LIMITS 8

/* The steps, as the error names them (index = the code the child reports). */
static const char *const steps[] = {
    "", "die with parent", "cgroup", "stdio", "descriptors", "limits", "no_new_privs",
    "landlock: restrict self", "seccomp", "exec",
};
enum { S_PARENT = 1, S_CGROUP, S_STDIO, S_FDS, S_LIMITS, S_NNP, S_LANDLOCK, S_SECCOMP, S_EXEC };

typedef struct {
    const char *path;
    char **argv, **envp;
    int in, out, err;
    int keep[MAX_KEEP], nkeep;  /* made inheritable */
    int hold[MAX_KEEP + 3], nhold;  /* kept open until the exec: keep, the error pipe, the ruleset; sorted */
    int cgroup_fd, ruleset_fd;
    int limit_which[MAX_LIMITS];
    rlim_t limit_value[MAX_LIMITS];
    int nlimits;
    struct sock_fprog prog;
    pid_t parent;
} Launch;

static void
report(int errpipe, int step, int code)
{
    int msg[2] = {step, code};
    while (write(errpipe, msg, sizeof msg) < 0 && errno == EINTR)
        ;
    _exit(127);
}

static void
child_after_vfork(const void *arg, int errpipe, const sigset_t *unblocked)
{
    const Launch *l = arg;
    dl_default_signals(1);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        report(errpipe, S_PARENT, errno);
    if (getppid() != l->parent)
        _exit(1);  /* the parent died before the prctl: nobody to start it for */
    if (l->cgroup_fd >= 0 && write(l->cgroup_fd, "0", 1) != 1)
        report(errpipe, S_CGROUP, errno);
    if (dup2(l->in, 0) < 0 || dup2(l->out, 1) < 0 || dup2(l->err, 2) < 0)
        report(errpipe, S_STDIO, errno);
    for (int i = 0; i < l->nkeep; i++)
        if (fcntl(l->keep[i], F_SETFD, 0) != 0)
            report(errpipe, S_FDS, errno);
    /* Every other descriptor closed, or no start: close_range (Linux 5.9)
     * is older than Landlock (5.13), which the daemon requires, so a
     * failure here is no kernel's answer to expect, and fails closed. */
    unsigned low = 3;
    for (int i = 0; i < l->nhold; i++) {
        if ((unsigned)l->hold[i] > low && syscall(SYS_close_range, low, (unsigned)l->hold[i] - 1, 0U) != 0)
            report(errpipe, S_FDS, errno);
        if ((unsigned)l->hold[i] >= low)
            low = (unsigned)l->hold[i] + 1;
    }
    if (syscall(SYS_close_range, low, ~0U, 0U) != 0)
        report(errpipe, S_FDS, errno);
    for (int i = 0; i < l->nlimits; i++) {
        struct rlimit r = {l->limit_value[i], l->limit_value[i]};
        if (setrlimit(l->limit_which[i], &r) != 0)
            report(errpipe, S_LIMITS, errno);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        report(errpipe, S_NNP, errno);
    if (l->ruleset_fd >= 0) {
        if (syscall(SYS_landlock_restrict_self, l->ruleset_fd, 0U) != 0)
            report(errpipe, S_LANDLOCK, errno);
        close(l->ruleset_fd);
    }
    if (l->prog.len > 0 && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &l->prog, 0, 0) != 0)
        report(errpipe, S_SECCOMP, errno);
    sigprocmask(SIG_SETMASK, unblocked, NULL);
    execve(l->path, l->argv, l->envp);
    report(errpipe, S_EXEC, errno);
}

static int
int_cmp(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* Everything but argv, envp and the pipe, checked and copied into ``l``. */
static int
prepare(Launch *l, PyObject *keep, int cgroup_fd, PyObject *limits, int ruleset_fd, Py_buffer *program)
{
    Py_ssize_t n = PyList_GET_SIZE(keep);
    if (n > MAX_KEEP) {
        PyErr_Format(PyExc_ValueError, "spawn_confined: at most %d descriptors kept", MAX_KEEP);
        return -1;
    }
    l->nkeep = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PyList_GET_ITEM(keep, i));
        if (fd == -1 && PyErr_Occurred())
            return -1;
        if (fd < 3 || fd > INT_MAX) {
            PyErr_SetString(PyExc_ValueError, "spawn_confined: the descriptors kept must be 3 or above");
            return -1;
        }
        l->keep[i] = (int)fd;
    }
    n = PyList_GET_SIZE(limits);
    if (n > MAX_LIMITS) {
        PyErr_Format(PyExc_ValueError, "spawn_confined: at most %d limits", MAX_LIMITS);
        return -1;
    }
    l->nlimits = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int which;
        unsigned long long value;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(limits, i), "iK", &which, &value))
            return -1;
        l->limit_which[i] = which;
        l->limit_value[i] = (rlim_t)value;
    }
    if (program->len % (Py_ssize_t)sizeof(struct sock_filter) != 0
        || program->len / (Py_ssize_t)sizeof(struct sock_filter) > BPF_MAXINSNS) {
        PyErr_SetString(PyExc_ValueError, "spawn_confined: the seccomp program is not a whole BPF program");
        return -1;
    }
    l->prog.len = (unsigned short)(program->len / (Py_ssize_t)sizeof(struct sock_filter));
    l->prog.filter = (struct sock_filter *)program->buf;
    l->cgroup_fd = cgroup_fd;
    l->ruleset_fd = ruleset_fd;
    return 0;
}

/* spawn_confined(path, argv, envp, stdin_fd, stdout_fd, stderr_fd, keep, cgroup_procs_fd, limits,
 *                ruleset_fd, seccomp_program, parent) -> pid
 *
 * ``keep``: the descriptors (3 or above) the program inherits, besides its
 * stdio. ``cgroup_procs_fd``: a cgroup's cgroup.procs open for writing, or
 * -1. ``limits``: (RLIMIT_*, value) pairs, soft = hard. ``ruleset_fd``: a
 * complete Landlock ruleset, or -1. ``seccomp_program``: classic BPF, or
 * b"" for none. ``parent``: the caller's pid (the child's parent-death
 * check). Raises OSError(errno, strerror, step) as a step or the exec
 * failed, the child reaped. */
PyObject *
dl_spawn_confined(PyObject *self, PyObject *args)
{
    PyObject *path_obj, *argv_obj, *envp_obj, *keep_obj, *limits_obj;
    int in, out, err, cgroup_fd, ruleset_fd, parent;
    Py_buffer program;
    if (!PyArg_ParseTuple(args, "SO!O!iiiO!iO!iy*i", &path_obj, &PyList_Type, &argv_obj, &PyList_Type, &envp_obj,
                          &in, &out, &err, &PyList_Type, &keep_obj, &cgroup_fd, &PyList_Type, &limits_obj,
                          &ruleset_fd, &program, &parent))
        return NULL;
    Launch l;
    memset(&l, 0, sizeof l);
    PyObject *result = NULL;
    int pipefd[2] = {-1, -1};
    int msg[2] = {0, 0};
    ssize_t got = 0;
    pid_t pid;
    if (in < 0 || out < 0 || err < 0) {
        PyErr_SetString(PyExc_ValueError, "spawn_confined: stdio needs three open descriptors");
        goto done;
    }
    if (prepare(&l, keep_obj, cgroup_fd, limits_obj, ruleset_fd, &program) < 0)
        goto done;
    l.argv = dl_bytes_array(argv_obj, "spawn_confined", "argv");
    if (l.argv == NULL)
        goto done;
    l.envp = dl_bytes_array(envp_obj, "spawn_confined", "envp");
    if (l.envp == NULL)
        goto done;
    l.path = PyBytes_AS_STRING(path_obj);
    l.in = in, l.out = out, l.err = err, l.parent = (pid_t)parent;
    if (dl_error_pipe(pipefd) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    memcpy(l.hold, l.keep, sizeof(int) * (size_t)l.nkeep);
    l.nhold = l.nkeep;
    l.hold[l.nhold++] = pipefd[1];
    if (ruleset_fd >= 0)
        l.hold[l.nhold++] = ruleset_fd;
    qsort(l.hold, (size_t)l.nhold, sizeof(int), int_cmp);
    pid = dl_vfork_run(child_after_vfork, &l, pipefd, msg, sizeof msg, &got);
    if (pid < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (got != 0) { /* a step failed (or its report cannot be read): the child reaped, say which */
        int code = got == (ssize_t)sizeof msg ? msg[1] : (got < 0 ? errno : EIO);
        int step = got == (ssize_t)sizeof msg && msg[0] >= 1 && msg[0] <= S_EXEC ? msg[0] : S_EXEC;
        PyObject *e = Py_BuildValue("(isz)", code, strerror(code), steps[step]);
        if (e != NULL) {
            PyErr_SetObject(PyExc_OSError, e);
            Py_DECREF(e);
        }
        goto done;
    }
    result = PyLong_FromLong((long)pid);
done:
    if (pipefd[0] >= 0)
        close(pipefd[0]);
    if (pipefd[1] >= 0)
        close(pipefd[1]);
    PyMem_Free(l.argv);
    PyMem_Free(l.envp);
    PyBuffer_Release(&program);
    return result;
}
