/* What _lines.c shares with _fastread.c (one extension, two files): the
 * numbering of read_file's lines, in two steps, and its read by descriptor.
 * _lines.c says what each guarantees. */
#ifndef DISPATCHD_LINES_H
#define DISPATCHD_LINES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <sys/types.h>

/* How many line ends the numbering keeps from its first pass (on the stack). */
#define DL_NEXT_CACHED 512

typedef struct {
    Py_ssize_t total;        /* the file's lines */
    Py_ssize_t start, stop;  /* the lines shown: [start, stop) */
    Py_ssize_t begin, span;  /* their bytes: data[begin, begin + span), the last newline left out */
    Py_ssize_t size;         /* the numbered text's bytes (before any decode) */
    Py_ssize_t ends[DL_NEXT_CACHED];
} DlNumbering;

int dl_number_plan(const char *data, Py_ssize_t n, Py_ssize_t start, Py_ssize_t end, DlNumbering *plan);
int dl_number_ascii(const char *data, const DlNumbering *plan);
char *dl_number_write(const char *data, const DlNumbering *plan, char *w);
int dl_open_beneath(int root_fd, const char *raw, Py_ssize_t len);
PyObject *dl_read_whole(int fd, Py_ssize_t cap, Py_ssize_t sniff);

/* _fastread.c */
PyObject *dl_serve_read(PyObject *self, PyObject *args);
PyObject *dl_lane_calls(PyObject *self, PyObject *unused);

/* _spawn.c */
PyObject *dl_spawn_subreaper(PyObject *self, PyObject *args);
char **dl_bytes_array(PyObject *seq, const char *fn, const char *what);
void dl_default_signals(int ignored_too);

/* A vfork's child: runs in the caller's memory until its exec, makes system
 * calls only, and never returns (a failure is written to ``errpipe``, then
 * _exit). ``unblocked``: the signal mask to exec with. */
typedef void (*dl_vfork_child)(const void *arg, int errpipe, const sigset_t *unblocked);
int dl_error_pipe(int fds[2]);
pid_t dl_vfork_run(dl_vfork_child child, const void *arg, int fds[2], void *report, size_t size, ssize_t *got);

/* _confined.c */
PyObject *dl_spawn_confined(PyObject *self, PyObject *args);

/* _ctimes.c */
PyObject *dl_subdir_ctimes(PyObject *self, PyObject *args);
PyObject *dl_recent_named(PyObject *self, PyObject *args);

#endif
