"""An NBD client with the names and behaviour of libnbd's Python module
(``import nbd``), over diskit's client (``diskit._diskit``).

A handle is made with ``NBD()``, configured (export name, metadata
contexts), connected (``connect_uri``, ``connect_unix``, ``connect_tcp``,
``connect_command``, ``connect_systemd_socket_activation``), then asked
(size, flags) and used: synchronous requests (``pread``, ``pwrite``,
``zero``, ``trim``, ``flush``, ``cache``, ``block_status``), and
asynchronous ones (``aio_*``) whose completions are taken by ``poll`` or
``aio_notify_read`` on the descriptor ``aio_get_fd`` gives. Errors are
``nbd.Error`` with the message (``.string``) and errno (``.errnum``).

In option mode (``set_opt_mode(True)`` before connecting) the handle
stops after the greeting (and structured replies), and ``opt_list``,
``opt_list_meta_context``, ``opt_info``, ``opt_go`` and ``opt_abort`` go
on from there, as libnbd's do.

Debug messages (``set_debug``, on by default when ``LIBNBD_DEBUG=1``)
go to the callback ``set_debug_callback`` gives, else to standard error
as libnbd prints them; they tell what the handle does (connecting, each
option, entering transmission, shutting down).

Not yet: TLS settings (an ``nbds://`` URI works; option mode is plain
connections only).
"""

import errno as _errno
import os
import sys
import urllib.parse

from diskit import _diskit

TLS_DISABLE = 0
TLS_ALLOW = 1
TLS_REQUIRE = 2
SIZE_MINIMUM = 0
SIZE_PREFERRED = 1
SIZE_MAXIMUM = 2
CMD_FLAG_FUA = 1
CMD_FLAG_NO_HOLE = 2
CMD_FLAG_DF = 4
CMD_FLAG_REQ_ONE = 8
CMD_FLAG_FAST_ZERO = 16
CMD_FLAG_MASK = 31
HANDSHAKE_FLAG_FIXED_NEWSTYLE = 1
HANDSHAKE_FLAG_NO_ZEROES = 2
HANDSHAKE_FLAG_MASK = 3
STRICT_COMMANDS = 1
STRICT_FLAGS = 2
STRICT_BOUNDS = 4
STRICT_ZERO_SIZE = 8
STRICT_ALIGN = 16
STRICT_MASK = 31
ALLOW_TRANSPORT_TCP = 1
ALLOW_TRANSPORT_UNIX = 2
ALLOW_TRANSPORT_VSOCK = 4
ALLOW_TRANSPORT_MASK = 7
SHUTDOWN_ABANDON_PENDING = 65536
SHUTDOWN_MASK = 65536
AIO_DIRECTION_READ = 1
AIO_DIRECTION_WRITE = 2
AIO_DIRECTION_BOTH = 3
READ_DATA = 1
READ_HOLE = 2
READ_ERROR = 3
NAMESPACE_BASE = "base:"
CONTEXT_BASE_ALLOCATION = "base:allocation"
STATE_HOLE = 1
STATE_ZERO = 2

# Transmission flags (the NBD protocol's).
_TF_READ_ONLY = 1 << 1
_TF_SEND_FLUSH = 1 << 2
_TF_SEND_FUA = 1 << 3
_TF_ROTATIONAL = 1 << 4
_TF_SEND_TRIM = 1 << 5
_TF_SEND_WRITE_ZEROES = 1 << 6
_TF_SEND_DF = 1 << 7
_TF_CAN_MULTI_CONN = 1 << 8
_TF_SEND_CACHE = 1 << 10
_TF_SEND_FAST_ZERO = 1 << 11


class Error(Exception):
    """A failed call: ``.string`` is the message, ``.errnum`` the errno
    (0 when there is none), ``.errno`` its name."""

    def __init__(self, string, errnum=0):
        super().__init__(string, errnum)

    @property
    def string(self):
        return self.args[0]

    @property
    def errnum(self):
        return self.args[1]

    @property
    def errno(self):
        return _errno.errorcode.get(self.errnum)

    def __str__(self):
        if self.errnum:
            return "%s (%s)" % (self.string, os.strerror(self.errnum))
        return self.string


def _raise_from(e):
    string, errnum = e.args if len(e.args) == 2 else (str(e), 0)
    raise Error(string, errnum) from None


class _Errno:
    """The error a callback sees and may change (``.value``)."""

    def __init__(self, value=0):
        self.value = value


class Buffer:
    """A buffer for asynchronous reads and writes."""

    def __init__(self, len):
        # Made (zeroed) only when first looked at, as libnbd's.
        self._o = bytes(len)

    @classmethod
    def from_buffer(cls, buf):
        """A buffer sharing ``buf`` (changes show both ways)."""
        self = cls(0)
        with memoryview(buf):
            self._o = buf
        self._init = True
        return self

    @classmethod
    def from_bytearray(cls, ba):
        """A buffer holding a copy of ``ba`` (or ``bytearray(ba)``)."""
        return cls.from_buffer(bytearray(ba))

    def to_buffer(self):
        """The buffer's bytes, shared."""
        if not hasattr(self, "_init"):
            self._o = bytearray(len(self._o))
            self._init = True
        return self._o

    def to_bytearray(self):
        """A copy of the buffer's bytes."""
        if not hasattr(self, "_init"):
            return bytearray(len(self._o))
        return bytearray(self._o)

    def size(self):
        return len(self)

    def __len__(self):
        return len(self._o)

    def is_zero(self, offset=0, size=-1):
        """Whether bytes ``offset`` to ``offset+size`` (the end when -1)
        are all zero."""
        if not hasattr(self, "_init"):
            return True
        view = memoryview(self._o).cast("B")
        end = len(view) if size == -1 else offset + size
        if offset < 0 or end > len(view) or end < offset:
            raise IndexError("range out of the buffer")
        chunk = view[offset:end]
        return not any(chunk)


def _writable(buf):
    """The bytearray (or writable buffer) an aio read fills."""
    if isinstance(buf, Buffer):
        return buf.to_buffer()
    mv = memoryview(buf)
    if mv.readonly:
        mv.release()
        raise BufferError("the buffer for a read must be writable")
    mv.release()
    return buf


class _Command:
    def __init__(self, kind, buf=None, view=None, offset=0,
                 completion=None, chunk=None):
        self.kind = kind
        self.buf = buf
        self.view = view
        self.offset = offset
        self.completion = completion
        self.chunk = chunk
        self.done = False
        self.error = 0


class NBD:
    """A handle: one connection to an NBD server."""

    def __init__(self):
        self._client = None
        # In option mode, before opt_go: the option phase, and what the
        # last opt_info told (size, flags, contexts agreed to).
        self._opts = None
        self._opt_info = None
        self._aborted = False
        self._export = ""
        self._contexts = []
        self._handle_name = None
        self._full_info = False
        self._tls = TLS_DISABLE
        self._structured = True
        self._block_size = True
        self._pread_init = True
        self._handshake_flags = HANDSHAKE_FLAG_MASK
        self._opt_mode = False
        self._strict = STRICT_MASK & ~STRICT_ALIGN
        self._uri = None
        self._next_cookie = 1
        self._commands = {}
        self._private = 0
        self._debug_on = os.environ.get("LIBNBD_DEBUG") == "1"
        self._debug_callback = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def close(self):
        """Closes the connection (the server it ran, if any, stops)."""
        if self._client is not None:
            self._client.close()
        if self._opts is not None:
            self._opts.abort()
            self._opts = None
            self._aborted = True

    # Settings.

    def set_export_name(self, name):
        if self._client is not None:
            raise Error("nbd_set_export_name: invalid state: the handle is "
                        "connected", _errno.EINVAL)
        self._export = name

    def get_export_name(self):
        return self._export

    def get_canonical_export_name(self):
        self._connected("nbd_get_canonical_export_name")
        return self._export

    def set_handle_name(self, name):
        self._handle_name = name

    def get_handle_name(self):
        if self._handle_name is None:
            self._handle_name = "nbd%d" % id(self)
        return self._handle_name

    def set_debug(self, debug):
        self._debug_on = bool(debug)

    def get_debug(self):
        return self._debug_on

    def set_debug_callback(self, debug):
        self._debug_callback = debug

    def clear_debug_callback(self):
        self._debug_callback = None

    def _debug(self, context, msg):
        """A debug message from the call ``context``, when debugging."""
        if not self._debug_on:
            return
        if self._debug_callback is not None:
            self._debug_callback(context, msg)
        else:
            sys.stderr.write("libnbd: debug: %s: %s: %s\n"
                             % (self.get_handle_name(), context, msg))

    def set_private_data(self, data):
        old, self._private = self._private, data
        return old

    def get_private_data(self):
        return self._private

    def set_full_info(self, full):
        self._full_info = bool(full)

    def get_full_info(self):
        return self._full_info

    def supports_tls(self):
        return False

    def supports_uri(self):
        return True

    def set_tls(self, tls):
        if tls not in (TLS_DISABLE, TLS_ALLOW, TLS_REQUIRE):
            raise Error("nbd_set_tls: invalid argument", _errno.EINVAL)
        if tls != TLS_DISABLE:
            raise Error("nbd_set_tls: TLS settings are not supported: use "
                        "an nbds:// URI", _errno.ENOTSUP)
        self._tls = tls

    def get_tls(self):
        return self._tls

    def get_tls_negotiated(self):
        return False

    def set_request_structured_replies(self, request):
        self._structured = bool(request)

    def get_request_structured_replies(self):
        return self._structured

    def set_request_block_size(self, request):
        self._block_size = bool(request)

    def get_request_block_size(self):
        return self._block_size

    def set_pread_initialize(self, init):
        self._pread_init = bool(init)

    def get_pread_initialize(self):
        return self._pread_init

    def set_handshake_flags(self, flags):
        if flags & ~HANDSHAKE_FLAG_MASK:
            raise Error("nbd_set_handshake_flags: invalid argument",
                        _errno.EINVAL)
        self._handshake_flags = flags

    def get_handshake_flags(self):
        return self._handshake_flags

    def set_strict_mode(self, flags):
        if flags & ~STRICT_MASK:
            raise Error("nbd_set_strict_mode: invalid argument",
                        _errno.EINVAL)
        self._strict = flags

    def get_strict_mode(self):
        return self._strict

    def set_opt_mode(self, enable):
        self._opt_mode = bool(enable)

    def get_opt_mode(self):
        return self._opt_mode

    def add_meta_context(self, name):
        if self._client is not None:
            raise Error("nbd_add_meta_context: invalid state: the handle is "
                        "connected", _errno.EINVAL)
        self._contexts.append(name)

    def get_nr_meta_contexts(self):
        return len(self._contexts)

    def get_meta_context(self, i):
        try:
            return self._contexts[i]
        except IndexError:
            raise Error("nbd_get_meta_context: index out of range",
                        _errno.EINVAL) from None

    def clear_meta_contexts(self):
        self._contexts = []

    def get_package_name(self):
        return "diskit"

    def get_version(self):
        return _diskit.VERSION

    # Connecting.

    def _connect(self, name, client_args, opts_args):
        """Connects with ``_diskit.Client.NAME(*client_args, export,
        contexts)``, or in option mode ``_diskit.Options.NAME(*opts_args,
        structured)``."""
        if self._client is not None or self._opts is not None:
            raise Error("nbd_%s: invalid state: the handle is already "
                        "connected" % name, _errno.EINVAL)
        context = "nbd_" + name
        self._debug(context, "connecting (option mode: %s, export: %r, "
                    "metadata contexts: %s)" % (self._opt_mode, self._export,
                                                self._contexts))
        try:
            if self._opt_mode:
                how = getattr(_diskit.Options, name)
                self._opts = how(*opts_args, self._structured)
            else:
                how = getattr(_diskit.Client, name)
                self._client = how(*client_args, list(self._contexts))
        except _diskit.Error as e:
            string, errnum = e.args
            self._debug(context, "failed: %s" % string)
            raise Error("%s: %s" % (context, string), errnum) from None
        if self._opt_mode:
            self._debug(context, "negotiating options (protocol %s, "
                        "structured replies: %s)"
                        % (self._opts.protocol(), self._opts.structured()))
        else:
            self._debug(context, "transmission started (size %d)"
                        % self._client.size())

    def connect_uri(self, uri):
        self._uri = uri
        parsed = urllib.parse.urlparse(uri)
        if self._opt_mode:
            self._export = urllib.parse.unquote(parsed.path[1:])
        self._connect("connect_uri", [uri], [uri])
        self._export = urllib.parse.unquote(parsed.path[1:])

    def connect_unix(self, unixsocket):
        uri = "nbd+unix:///%s?socket=%s" % (
            urllib.parse.quote(self._export),
            urllib.parse.quote(unixsocket))
        self._uri = uri
        self._connect("connect_uri", [uri], [uri])

    def connect_tcp(self, hostname, port):
        host = hostname if ":" not in hostname else "[%s]" % hostname
        uri = "nbd://%s:%s/%s" % (host, port,
                                  urllib.parse.quote(self._export))
        self._uri = uri
        self._connect("connect_uri", [uri], [uri])

    def connect_command(self, argv):
        self._connect("connect_command", [list(argv), self._export],
                      [list(argv)])

    def connect_systemd_socket_activation(self, argv):
        self._connect("connect_socket_activation",
                      [list(argv), self._export], [list(argv)])

    # Option mode.

    def _negotiating(self, what):
        if self._opts is None or self._opts.is_closed():
            raise Error("%s: invalid state: the handle is not negotiating "
                        "options (set_opt_mode(True) before connecting)"
                        % what, _errno.EINVAL)
        return self._opts

    def _opt(self, what, f, *args):
        o = self._negotiating(what)
        self._debug(what, "sending the option (export %r)" % self._export)
        try:
            r = getattr(o, f)(*args)
        except _diskit.Error as e:
            string, errnum = e.args
            self._debug(what, "the server refused: %s" % string)
            raise Error("%s: %s" % (what, string), errnum) from None
        self._debug(what, "the server replied")
        return r

    def opt_list(self, list):
        exports = self._opt("nbd_opt_list", "list")
        for name, description in exports:
            list(name, description)
        return len(exports)

    def opt_list_meta_context(self, context):
        names = self._opt("nbd_opt_list_meta_context", "list_meta_contexts",
                          self._export, list(self._contexts))
        for name in names:
            context(name)
        return len(names)

    def opt_info(self):
        self._opt_info = None
        self._opt_info = self._opt("nbd_opt_info", "info", self._export,
                                   list(self._contexts))

    def opt_go(self):
        o = self._negotiating("nbd_opt_go")
        self._opt_info = None
        self._debug("nbd_opt_go", "entering transmission on %r"
                    % self._export)
        try:
            self._client = o.go(self._export, list(self._contexts))
        except _diskit.Error as e:
            string, errnum = e.args
            self._debug("nbd_opt_go", "the server refused: %s" % string)
            raise Error("nbd_opt_go: %s" % string, errnum) from None
        self._opts = None

    def opt_abort(self):
        self._negotiating("nbd_opt_abort").abort()
        self._aborted = True

    def get_uri(self):
        if self._uri is None:
            raise Error("nbd_get_uri: the handle was not connected by a URI",
                        _errno.EINVAL)
        return self._uri

    def shutdown(self, flags=0):
        if self._opts is None:
            self._connected("nbd_shutdown")
        self._debug("nbd_shutdown", "disconnecting")
        self.close()

    def kill_subprocess(self, signum=0):
        self.close()

    # State.

    def _connected(self, what):
        if self._client is None and (self._opts is not None or self._aborted):
            # Negotiating without the export's information, or left: what
            # libnbd says of an export it knows nothing of.
            raise Error("%s: the server has not returned the export's "
                        "information (opt_info or opt_go)" % what,
                        _errno.EINVAL)
        if self._client is None or self._client.is_closed():
            raise Error("%s: invalid state: the handle is not connected"
                        % what, _errno.ENOTCONN)
        return self._client

    def _flags(self, what):
        """The export's transmission flags: the connection's, or what
        opt_info told while negotiating."""
        if self._client is None and self._opt_info is not None:
            return self._opt_info[1]
        try:
            return self._connected(what).flags()
        except _diskit.Error as e:
            _raise_from(e)

    def _flag(self, bit, what):
        return bool(self._flags(what) & bit)

    def aio_is_closed(self):
        if self._aborted:
            return True
        return self._client is not None and self._client.is_closed()

    def aio_is_ready(self):
        return self._client is not None and not self._client.is_closed()

    def aio_is_created(self):
        return (self._client is None and self._opts is None
                and not self._aborted)

    def aio_is_connecting(self):
        return False

    def aio_is_negotiating(self):
        return self._opts is not None and not self._opts.is_closed()

    def aio_is_processing(self):
        return self.aio_is_ready() and self.aio_in_flight() > 0

    def aio_is_dead(self):
        return False

    def connection_state(self):
        if self.aio_is_negotiating():
            return "NEGOTIATING"
        if self._aborted:
            return "CLOSED"
        if self._client is None:
            return "START"
        return "CLOSED" if self._client.is_closed() else "READY"

    def get_protocol(self):
        if self.aio_is_negotiating():
            return self._opts.protocol()
        self._connected("nbd_get_protocol")
        return "newstyle-fixed"

    def get_structured_replies_negotiated(self):
        if self.aio_is_negotiating():
            return bool(self._opts.structured())
        return bool(self._connected(
            "nbd_get_structured_replies_negotiated").structured())

    def get_size(self):
        if self._client is None and self._opt_info is not None:
            return self._opt_info[0]
        try:
            return self._connected("nbd_get_size").size()
        except _diskit.Error as e:
            _raise_from(e)

    def is_read_only(self):
        return self._flag(_TF_READ_ONLY, "nbd_is_read_only")

    def is_rotational(self):
        return self._flag(_TF_ROTATIONAL, "nbd_is_rotational")

    def can_flush(self):
        return self._flag(_TF_SEND_FLUSH, "nbd_can_flush")

    def can_fua(self):
        return self._flag(_TF_SEND_FUA, "nbd_can_fua")

    def can_trim(self):
        return self._flag(_TF_SEND_TRIM, "nbd_can_trim")

    def can_zero(self):
        return self._flag(_TF_SEND_WRITE_ZEROES, "nbd_can_zero")

    def can_fast_zero(self):
        return self._flag(_TF_SEND_FAST_ZERO, "nbd_can_fast_zero")

    def can_df(self):
        return self._flag(_TF_SEND_DF, "nbd_can_df")

    def can_multi_conn(self):
        return self._flag(_TF_CAN_MULTI_CONN, "nbd_can_multi_conn")

    def can_cache(self):
        return self._flag(_TF_SEND_CACHE, "nbd_can_cache")

    def can_meta_context(self, name):
        if self._client is None and self._opt_info is not None:
            return name in self._opt_info[2]
        return bool(self._connected("nbd_can_meta_context")
                    .offers_context(name))

    # Synchronous requests.

    def _call(self, what, f, *args):
        c = self._connected(what)
        try:
            return getattr(c, f)(*args)
        except _diskit.Error as e:
            _raise_from(e)

    @staticmethod
    def _check_flags(what, flags, allowed):
        if flags & ~allowed:
            raise Error("%s: invalid flags" % what, _errno.EINVAL)

    def pread(self, count, offset, flags=0):
        self._check_flags("nbd_pread", flags, CMD_FLAG_DF)
        return bytearray(self._call("nbd_pread", "pread", count, offset))

    def pread_structured(self, count, offset, chunk, flags=0):
        self._check_flags("nbd_pread_structured", flags, CMD_FLAG_DF)
        buf = bytearray(self._call("nbd_pread_structured", "pread",
                                   count, offset))
        err = _Errno()
        try:
            chunk(memoryview(buf).toreadonly(), offset, READ_DATA, err)
        except Exception:
            raise Error("nbd_pread_structured: the chunk callback failed",
                        err.value or _errno.EPROTO) from None
        return buf

    def pwrite(self, buf, offset, flags=0):
        self._check_flags("nbd_pwrite", flags, CMD_FLAG_FUA)
        self._call("nbd_pwrite", "pwrite", bytes(buf), offset,
                   bool(flags & CMD_FLAG_FUA))

    def zero(self, count, offset, flags=0):
        self._check_flags("nbd_zero", flags,
                          CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO)
        self._call("nbd_zero", "zero", count, offset,
                   bool(flags & CMD_FLAG_FUA),
                   not flags & CMD_FLAG_NO_HOLE,
                   bool(flags & CMD_FLAG_FAST_ZERO))

    def trim(self, count, offset, flags=0):
        self._check_flags("nbd_trim", flags, CMD_FLAG_FUA)
        self._call("nbd_trim", "trim", count, offset,
                   bool(flags & CMD_FLAG_FUA))

    def flush(self, flags=0):
        self._check_flags("nbd_flush", flags, 0)
        self._call("nbd_flush", "flush")

    def cache(self, count, offset, flags=0):
        self._check_flags("nbd_cache", flags, 0)
        self._call("nbd_cache", "cache", count, offset)

    def block_status(self, count, offset, extent, flags=0):
        """Calls ``extent(metacontext, offset, entries, err)`` for each
        metacontext negotiated, ``entries`` the server's (length, flags)
        pairs flattened."""
        self._check_flags("nbd_block_status", flags, CMD_FLAG_REQ_ONE)
        c = self._connected("nbd_block_status")
        names = [n for n in self._contexts if c.offers_context(n)]
        if not names:
            raise Error("nbd_block_status: did not negotiate any metadata "
                        "contexts, either you did not call "
                        "nbd_add_meta_context before connecting or the "
                        "server does not support it", _errno.ENOTSUP)
        for name in names:
            pairs = self._call("nbd_block_status", "block_status", name,
                               count, offset, flags & CMD_FLAG_REQ_ONE)
            entries = [v for pair in pairs for v in pair]
            err = _Errno()
            try:
                extent(name, offset, entries, err)
            except Exception:
                raise Error("nbd_block_status: the extent callback failed",
                            err.value or _errno.EPROTO) from None

    # Asynchronous requests.

    def _submit(self, cmd, what, f, *args):
        c = self._connected(what)
        cookie = self._next_cookie
        self._next_cookie += 1
        self._commands[cookie] = cmd
        try:
            getattr(c, f)(cookie, *args)
        except _diskit.Error as e:
            del self._commands[cookie]
            _raise_from(e)
        return cookie

    def _run_now(self, cmd, what, f, *args):
        """A request the client runs at once, finished on its return."""
        c = self._connected(what)
        cookie = self._next_cookie
        self._next_cookie += 1
        self._commands[cookie] = cmd
        try:
            getattr(c, f)(*args)
            c.finish(cookie, 0)
        except _diskit.Error as e:
            c.finish(cookie, e.args[1] if len(e.args) == 2 else _errno.EIO)
        return cookie

    def aio_pread(self, buf, offset, completion=None, flags=0):
        self._check_flags("nbd_aio_pread", flags, CMD_FLAG_DF)
        target = _writable(buf)
        view = memoryview(target)
        cmd = _Command("read", target, view, offset, completion)
        return self._submit(cmd, "nbd_aio_pread", "submit_pread",
                            len(view), offset)

    def aio_pread_structured(self, buf, offset, chunk, completion=None,
                             flags=0):
        self._check_flags("nbd_aio_pread_structured", flags, CMD_FLAG_DF)
        target = _writable(buf)
        view = memoryview(target)
        cmd = _Command("read", target, view, offset, completion, chunk)
        return self._submit(cmd, "nbd_aio_pread_structured", "submit_pread",
                            len(view), offset)

    def aio_pwrite(self, buf, offset, completion=None, flags=0):
        self._check_flags("nbd_aio_pwrite", flags, CMD_FLAG_FUA)
        data = buf.to_buffer() if isinstance(buf, Buffer) else buf
        # The buffer may not be resized while the write is pending.
        view = memoryview(data)
        cmd = _Command("write", view=view, completion=completion)
        return self._submit(cmd, "nbd_aio_pwrite", "submit_pwrite",
                            view.tobytes(), offset, bool(flags & CMD_FLAG_FUA))

    def aio_zero(self, count, offset, completion=None, flags=0):
        self._check_flags("nbd_aio_zero", flags,
                          CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO)
        cmd = _Command("zero", completion=completion)
        return self._submit(cmd, "nbd_aio_zero", "submit_zero", count,
                            offset, bool(flags & CMD_FLAG_FUA),
                            not flags & CMD_FLAG_NO_HOLE,
                            bool(flags & CMD_FLAG_FAST_ZERO))

    def aio_trim(self, count, offset, completion=None, flags=0):
        self._check_flags("nbd_aio_trim", flags, CMD_FLAG_FUA)
        cmd = _Command("trim", completion=completion)
        return self._run_now(cmd, "nbd_aio_trim", "trim", count, offset,
                             bool(flags & CMD_FLAG_FUA))

    def aio_flush(self, completion=None, flags=0):
        self._check_flags("nbd_aio_flush", flags, 0)
        cmd = _Command("flush", completion=completion)
        return self._run_now(cmd, "nbd_aio_flush", "flush")

    def aio_cache(self, count, offset, completion=None, flags=0):
        self._check_flags("nbd_aio_cache", flags, 0)
        cmd = _Command("cache", completion=completion)
        return self._run_now(cmd, "nbd_aio_cache", "cache", count, offset)

    def aio_get_fd(self):
        return self._connected("nbd_aio_get_fd").event_fd()

    def aio_get_direction(self):
        if self._client is None or self._client.is_closed():
            return 0
        return AIO_DIRECTION_READ

    def aio_notify_read(self):
        self._take()

    def aio_notify_write(self):
        pass

    def aio_in_flight(self):
        return sum(1 for c in self._commands.values() if not c.done)

    def poll(self, timeout):
        """Waits up to ``timeout`` ms (-1: for ever) for completions and
        handles them; 1 when some came, 0 on timeout."""
        c = self._connected("nbd_poll")
        if not c.wait(timeout):
            return 0
        self._take()
        return 1

    def _take(self):
        c = self._client
        if c is None:
            return
        for cookie, errnum, data in c.take():
            cmd = self._commands.get(cookie)
            if cmd is None:
                continue
            self._finish(cookie, cmd, errnum, data)

    def _finish(self, cookie, cmd, errnum, data):
        cmd.done = True
        err = _Errno(errnum)
        if cmd.kind == "read" and errnum == 0 and data is not None:
            cmd.view[:len(data)] = data
        if cmd.view is not None:
            cmd.view.release()
        if cmd.kind == "read":
            if errnum == 0 and cmd.chunk is not None:
                try:
                    cmd.chunk(memoryview(cmd.buf).toreadonly(), cmd.offset,
                              READ_DATA, err)
                except Exception:
                    errnum = err.value or _errno.EPROTO
                err = _Errno(errnum)
        cmd.error = errnum
        retire = False
        if cmd.completion is not None:
            try:
                retire = cmd.completion(err) == 1
            except Exception:
                cmd.error = err.value or _errno.EPROTO
        if retire:
            self._commands.pop(cookie, None)

    def aio_command_completed(self, cookie):
        self._take()
        cmd = self._commands.get(cookie)
        if cmd is None:
            raise Error("nbd_aio_command_completed: invalid cookie",
                        _errno.EINVAL)
        if not cmd.done:
            return False
        del self._commands[cookie]
        if cmd.error:
            raise Error("nbd_aio_command_completed: command failed",
                        cmd.error)
        return True

    def aio_peek_command_completed(self):
        self._take()
        for cookie, cmd in self._commands.items():
            if cmd.done:
                return cookie
        if not self._commands:
            raise Error("nbd_aio_peek_command_completed: no commands are "
                        "in flight", _errno.EINVAL)
        return 0
