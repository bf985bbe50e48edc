/* spawn_subreaper: start a command as subprocess.Popen would (vfork, then
 * exec), made a child subreaper first, under the resource limits it is given.
 *
 * Why: every process a call starts must be found when the call is ended
 * (tools/proctree.py). A child subreaper receives the orphans of its
 * descendants, and the attribute survives execve: with bash one, whatever a
 * command starts stays in bash's tree, however it detaches (setsid, a double
 * fork, a cleared environment), for as long as bash lives. Popen's
 * preexec_fn could set it, but rules out vfork (a fork of the tool server:
 * +1.5 ms a call, measured), and a wrapper program costs an exec (+2 ms).
 *
 * Safety (this runs between vfork and exec, in the caller's memory):
 * - everything the child needs (argv, envp, cwd) is built before vfork; the
 *   child makes system calls only, allocates nothing and never returns;
 * - every signal is blocked across the vfork, and the child resets every
 *   handled signal to its default before unblocking: no Python handler can
 *   run in the child; SIGPIPE and SIGXFSZ (ignored by Python) are reset as
 *   Popen's restore_signals does;
 * - the GIL is held throughout (the caller's thread is suspended until the
 *   exec anyway: about a millisecond);
 * - an exec that fails writes its errno to a close-on-exec pipe: the caller
 *   gets the OSError, and the child is reaped here.
 *
 * The limits (RLIMIT_NPROC, RLIMIT_NOFILE; soft = hard) are set in the child
 * before its exec: the command's first instruction, and every process it
 * forks, runs under them. A vfork child has limits of its own (no
 * CLONE_THREAD: its own signal struct), so the caller's are untouched. Set
 * by the caller after the spawn instead, a command that forked or raised its
 * soft limit back first kept the caller's hard one.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "_lines.h"

#ifndef PR_SET_CHILD_SUBREAPER
#define PR_SET_CHILD_SUBREAPER 36
#endif

/* A NULL-terminated array of the bytes objects in ``seq`` (borrowed pointers:
 * ``seq`` must outlive it; PyMem_Free it). NULL with an exception set on
 * failure, which names ``fn`` and ``what``. */
char **
dl_bytes_array(PyObject *seq, const char *fn, const char *what)
{
    Py_ssize_t n = PyList_Check(seq) ? PyList_GET_SIZE(seq) : -1;
    if (n < 0) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be a list of bytes", fn, what);
        return NULL;
    }
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(seq, i);
        if (!PyBytes_Check(item) || (Py_ssize_t)strlen(PyBytes_AS_STRING(item)) != PyBytes_GET_SIZE(item)) {
            PyMem_Free(out);
            PyErr_Format(PyExc_ValueError, "%s: %s must be bytes without NUL", fn, what);
            return NULL;
        }
        out[i] = PyBytes_AS_STRING(item);
    }
    return out;
}

/* Soft and hard ``value`` for ``which``; a negative ``value`` leaves it. */
static int
limit_to(int which, long long value)
{
    if (value < 0)
        return 0;
    struct rlimit r = {(rlim_t)value, (rlim_t)value};
    return setrlimit(which, &r);
}

/* In a vfork's child: every handled signal back to its default, and
 * SIGPIPE and SIGXFSZ (which Python ignores), as subprocess's
 * restore_signals; with ``ignored_too``, every ignored one as well. The
 * child's handlers are its own (no CLONE_SIGHAND): the caller's stay. */
void
dl_default_signals(int ignored_too)
{
    struct sigaction dfl, old;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP)
            continue;
        if (sigaction(sig, NULL, &old) != 0 || old.sa_handler == SIG_DFL)
            continue;
        if (old.sa_handler != SIG_IGN || ignored_too || sig == SIGPIPE || sig == SIGXFSZ)
            sigaction(sig, &dfl, NULL);
    }
}

typedef struct {
    const char *path, *cwd;
    char **argv, **envp;
    int in, out, err;
    long long nproc, nofile;
} Command;

static void
child_after_vfork(const void *arg, int errpipe, const sigset_t *unblocked)
{
    const Command *c = arg;
    dl_default_signals(0);
    int code = 0;
    if (setsid() < 0 || prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 || dup2(c->in, 0) < 0 || dup2(c->out, 1) < 0
        || dup2(c->err, 2) < 0 || chdir(c->cwd) != 0 || limit_to(RLIMIT_NPROC, c->nproc) != 0
        || limit_to(RLIMIT_NOFILE, c->nofile) != 0)
        code = errno;
    if (code == 0) {
        /* Nothing of the caller's but stdio and the error pipe (close-on-exec). */
        if (errpipe > 3)
            syscall(SYS_close_range, 3U, (unsigned)errpipe - 1, 0U);
        syscall(SYS_close_range, (unsigned)errpipe + 1, ~0U, 0U);
        sigprocmask(SIG_SETMASK, unblocked, NULL);
        execve(c->path, c->argv, c->envp);
        code = errno;
    }
    while (write(errpipe, &code, sizeof code) < 0 && errno == EINTR)
        ;
    _exit(127);
}

/* A close-on-exec pipe for a vfork child's report, its write end 3 or above
 * (the child's stdio goes to 0-2). 0, or -1 with errno set. */
int
dl_error_pipe(int fds[2])
{
    if (pipe2(fds, O_CLOEXEC) != 0)
        return -1;
    if (fds[1] < 3) { /* cannot be in the tool server or the fork server (0-2 are open), but may elsewhere */
        int moved = fcntl(fds[1], F_DUPFD_CLOEXEC, 3);
        int saved = errno;
        close(fds[1]);
        fds[1] = moved;
        if (moved < 0) {
            close(fds[0]);
            fds[0] = -1;
            errno = saved;
            return -1;
        }
    }
    return 0;
}

/* The frame both launches share: ``child(arg)`` run in a vfork's child with
 * every signal blocked across the vfork (no Python handler can run in it;
 * the child unblocks them before its exec), the caller's mask back after,
 * then the child's report read from ``fds`` (a dl_error_pipe, both ends
 * closed here). Returns the child's pid, with ``*got`` 0 when it reported
 * nothing (its exec happened); ``*got`` otherwise what the read returned,
 * ``size`` bytes of ``report`` when whole, and the child reaped, killed
 * first when its report could not be read (it may have run its exec: never
 * left running unknown). -1 with errno set when vfork failed. */
pid_t
dl_vfork_run(dl_vfork_child child, const void *arg, int fds[2], void *report, size_t size, ssize_t *got)
{
    sigset_t all, old, unblocked;
    sigfillset(&all);
    sigemptyset(&unblocked);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = vfork();
    if (pid == 0)
        child(arg, fds[1], &unblocked);
    int fork_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    close(fds[1]);
    fds[1] = -1;
    if (pid < 0) {
        close(fds[0]);
        fds[0] = -1;
        errno = fork_errno;
        return -1;
    }
    ssize_t n;
    do {
        n = read(fds[0], report, size);
    } while (n < 0 && errno == EINTR);
    int read_errno = errno;
    close(fds[0]);
    fds[0] = -1;
    *got = n;
    if (n != 0) {
        if (n < 0)
            kill(pid, SIGKILL);
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
        if (n < 0)
            errno = read_errno;
    }
    return pid;
}

/* spawn_subreaper(path, argv, envp, cwd, stdin_fd, stdout_fd, stderr_fd, nproc, nofile) -> pid
 *
 * All three descriptors must be 3 or above (the caller's pipes and its
 * /dev/null). ``nproc`` and ``nofile``: the child's RLIMIT_NPROC and
 * RLIMIT_NOFILE, soft and hard, or -1 to leave it the caller's. Raises
 * OSError as the fork, a limit or the exec failed (BlockingIOError: EAGAIN,
 * the process limit). */
PyObject *
dl_spawn_subreaper(PyObject *self, PyObject *args)
{
    PyObject *path_obj, *argv_obj, *envp_obj, *cwd_obj;
    Command c;
    if (!PyArg_ParseTuple(args, "SO!O!SiiiLL", &path_obj, &PyList_Type, &argv_obj, &PyList_Type, &envp_obj,
                          &cwd_obj, &c.in, &c.out, &c.err, &c.nproc, &c.nofile))
        return NULL;
    if (c.in < 3 || c.out < 3 || c.err < 3) {
        PyErr_SetString(PyExc_ValueError, "spawn_subreaper: the descriptors must be 3 or above");
        return NULL;
    }
    c.argv = dl_bytes_array(argv_obj, "spawn_subreaper", "argv");
    if (c.argv == NULL)
        return NULL;
    c.envp = dl_bytes_array(envp_obj, "spawn_subreaper", "envp");
    if (c.envp == NULL) {
        PyMem_Free(c.argv);
        return NULL;
    }
    c.path = PyBytes_AS_STRING(path_obj);
    c.cwd = PyBytes_AS_STRING(cwd_obj);
    int fds[2];
    int code = 0;
    ssize_t got = 0;
    pid_t pid = dl_error_pipe(fds) != 0 ? -1 : dl_vfork_run(child_after_vfork, &c, fds, &code, sizeof code, &got);
    int saved = errno; /* EAGAIN at the process limit: BlockingIOError, which the caller tells apart */
    PyMem_Free(c.argv);
    PyMem_Free(c.envp);
    errno = saved;
    if (pid < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    if (got != 0) { /* the exec failed (reaped): say why */
        if (got == (ssize_t)sizeof code)
            errno = code;
        else if (got > 0)
            errno = EIO;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
    }
    return PyLong_FromLong((long)pid);
}
