/* Receiving a big reply from a socket into a given buffer, without the GIL.
 *
 * Python's socket.recv_into returns what the kernel has queued, a few hundred KiB at most
 * on loopback, so a 4 MiB value takes dozens of calls, and each one gives the GIL up and
 * takes it back. With one reading thread per Redis master, those handovers, not the
 * copies, become what limits a fast cluster. Here the whole buffer is filled in one call:
 *
 *   receive_exact(fd, buffer, timeout) -> bool
 *       fills `buffer` (any writable, C-contiguous buffer) from socket `fd`, waiting at
 *       most `timeout` seconds for each part to arrive (a negative timeout waits for
 *       ever), as socket.recv_into would with that timeout. True once it is full, False
 *       when the peer closed the connection first; raises TimeoutError when a part takes
 *       longer than the timeout, OSError (as socket calls do) for any other failure. The
 *       socket may be blocking or not.
 *
 * Optional like the rest of kvdepot.native: storage/shard_io.py loops over recv_into
 * where this extension was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sys/socket.h>

enum outcome { FILLED, CLOSED, TIMED_OUT, FAILED, INTERRUPTED };

/* Runs without the GIL; advances `*at` and `*remaining` as bytes arrive. On FAILED,
 * errno says why. */
static enum outcome fill(int fd, char **at, size_t *remaining, int timeout_ms) {
    while (*remaining > 0) {
        ssize_t got = recv(fd, *at, *remaining, 0);
        if (got > 0) {
            *at += got;
            *remaining -= (size_t)got;
            continue;
        }
        if (got == 0) {
            return CLOSED;
        }
        if (errno == EINTR) {
            return INTERRUPTED;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            return FAILED;
        }
        struct pollfd wanted = {.fd = fd, .events = POLLIN};
        int ready = poll(&wanted, 1, timeout_ms);
        if (ready == 0) {
            return TIMED_OUT;
        }
        if (ready < 0) {
            return errno == EINTR ? INTERRUPTED : FAILED;
        }
    }
    return FILLED;
}

static PyObject *receive_exact(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "receive_exact(fd, buffer, timeout)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    double timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    int timeout_ms = timeout < 0 ? -1 : timeout * 1000 > INT_MAX ? INT_MAX
                                                                    : (int)(timeout * 1000);
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        return NULL;
    }
    char *at = view.buf;
    size_t remaining = (size_t)view.len;
    enum outcome result;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        result = fill((int)fd, &at, &remaining, timeout_ms);
        Py_END_ALLOW_THREADS
        if (result != INTERRUPTED) {
            break;
        }
        /* A signal: let its Python handler run (and raise, for Ctrl-C), then go on
         * where the receive stopped. */
        if (PyErr_CheckSignals() != 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    int saved_errno = errno;
    PyBuffer_Release(&view);
    switch (result) {
    case FILLED:
        Py_RETURN_TRUE;
    case CLOSED:
        Py_RETURN_FALSE;
    case TIMED_OUT:
        PyErr_SetString(PyExc_TimeoutError, "timed out");
        return NULL;
    default:
        errno = saved_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

static PyMethodDef METHODS[] = {
    {"receive_exact", (PyCFunction)(void (*)(void))receive_exact, METH_FASTCALL,
     "Fill a writable buffer from socket fd, the GIL released; timeout in seconds per "
     "wait (negative: none). False if the peer closed the connection first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_receive", NULL, -1, METHODS, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__receive(void) { return PyModule_Create(&MODULE); }
