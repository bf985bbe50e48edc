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

static void
child_after_vfork(const char *path, char **argv, char **envp, const char *cwd, int in, int out, int err,
                  int errpipe, const sigset_t *unblocked, long long nproc, long long nofile)
{
    dl_default_signals(0);
    int code = 0;
    if (setsid() < 0 || prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 || dup2(in, 0) < 0 || dup2(out, 1) < 0
        || dup2(err, 2) < 0 || chdir(cwd) != 0 || limit_to(RLIMIT_NPROC, nproc) != 0
        || limit_to(RLIMIT_NOFILE, nofile) != 0)
        code = errno;
    if (code == 0) {
        /* Nothing of the caller's but stdio and the error pipe (close-on-exec). */
        if (errpipe > 3)
            syscall(SYS_close_range, 3U, (unsigned)errpipe - 1, 0U);
        syscall(SYS_close_range, (unsigned)errpipe + 1, ~0U, 0U);
        sigprocmask(SIG_SETMASK, unblocked, NULL);
        execve(path, argv, envp);
        code = errno;
    }
    while (write(errpipe, &code, sizeof code) < 0 && errno == EINTR)
        ;
    _exit(127);
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
    int in, out, err;
    long long nproc, nofile;
    if (!PyArg_ParseTuple(args, "SO!O!SiiiLL", &path_obj, &PyList_Type, &argv_obj, &PyList_Type, &envp_obj,
                          &cwd_obj, &in, &out, &err, &nproc, &nofile))
        return NULL;
    if (in < 3 || out < 3 || err < 3) {
        PyErr_SetString(PyExc_ValueError, "spawn_subreaper: the descriptors must be 3 or above");
        return NULL;
    }
    char **argv = dl_bytes_array(argv_obj, "spawn_subreaper", "argv");
    if (argv == NULL)
        return NULL;
    char **envp = dl_bytes_array(envp_obj, "spawn_subreaper", "envp");
    if (envp == NULL) {
        PyMem_Free(argv);
        return NULL;
    }
    const char *path = PyBytes_AS_STRING(path_obj), *cwd = PyBytes_AS_STRING(cwd_obj);
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        PyMem_Free(argv);
        PyMem_Free(envp);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (pipefd[1] < 3) { /* cannot be (0, 1 and 2 are open in the tool server), but the child needs it above */
        int moved = fcntl(pipefd[1], F_DUPFD_CLOEXEC, 3);
        close(pipefd[1]);
        pipefd[1] = moved;
    }
    sigset_t all, old, unblocked;
    sigfillset(&all);
    sigemptyset(&unblocked);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = pipefd[1] < 0 ? -1 : vfork();
    if (pid == 0)
        child_after_vfork(path, argv, envp, cwd, in, out, err, pipefd[1], &unblocked, nproc, nofile);
    int fork_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pipefd[1] >= 0)
        close(pipefd[1]);
    PyMem_Free(argv);
    PyMem_Free(envp);
    if (pid < 0) {
        close(pipefd[0]);
        errno = fork_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    int code = 0;
    ssize_t got;
    do {
        got = read(pipefd[0], &code, sizeof code);
    } while (got < 0 && errno == EINTR);
    close(pipefd[0]);
    if (got == (ssize_t)sizeof code) { /* the exec failed: reap the child, say why */
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
        errno = code;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_obj);
    }
    return PyLong_FromLong((long)pid);
}
