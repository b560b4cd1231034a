//! One end of a PSK session as the sans-I/O [`Session`] the TLS plumbing
//! drives: ciphertext is fed in, plaintext comes out, records are taken
//! away to be sent.

use std::io;

use super::openssl::{PskCallback, Ssl, SslError, WANT_READ, ZERO_RETURN};
use crate::tls::Session;

/// Plaintext encrypted per call (four full records).
const MAX_WRITE: usize = 64 * 1024;

/// What differs between the two ends of a PSK session: the PSK callback
/// (the key lookup, or the identity and key to send), how a failed
/// handshake is explained, and whose identity the session runs under.
pub(crate) trait PskRole: PskCallback {
    /// The other end, in messages: "client" or "server".
    const PEER: &'static str;

    /// Why the handshake failed, in words (OpenSSL's error follows).
    fn why_failed(&self) -> String;

    /// The PSK identity, shown for logs.
    fn identity(&self) -> String;
}

/// One end of an OpenSSL PSK session.
pub(crate) struct PskSession<R> {
    ssl: Ssl<R>,
}

impl<R: PskRole> PskSession<R> {
    /// The server end, on `ssl`, waiting for the client's hello.
    pub(crate) fn accept(ssl: Ssl<R>) -> PskSession<R> {
        PskSession { ssl }
    }

    /// The client end, on `ssl`: its hello is sealed at once, ready to
    /// go out.
    pub(crate) fn connect(ssl: Ssl<R>) -> io::Result<PskSession<R>> {
        let mut session = PskSession { ssl };
        match session.ssl.do_handshake() {
            Err(e) if e.code() == WANT_READ => Ok(session),
            Ok(()) => Err(io::Error::other(
                "TLS-PSK: OpenSSL finished a handshake before the server spoke",
            )),
            Err(e) => Err(session.handshake_error(&e)),
        }
    }

    /// Why the handshake failed, in words: what the role knows, then what
    /// OpenSSL says.
    fn handshake_error(&self, e: &SslError) -> io::Error {
        io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("TLS-PSK: {}: {e}", self.ssl.state().why_failed()),
        )
    }
}

impl<R: PskRole> Session for PskSession<R> {
    fn is_handshaking(&self) -> bool {
        !self.ssl.is_init_finished()
    }

    fn feed(&mut self, input: &[u8]) -> io::Result<usize> {
        let handshaking = self.is_handshaking();
        if input.is_empty() {
            self.ssl.set_eof();
            if handshaking {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("{} closed the connection during the TLS handshake", R::PEER),
                ));
            }
        } else {
            self.ssl
                .push(input)
                .map_err(|e| io::Error::other(format!("TLS: {e}")))?;
        }
        if handshaking {
            match self.ssl.do_handshake() {
                Ok(()) => {}
                Err(e) if e.code() == WANT_READ && !self.ssl.eof() => {}
                Err(e) => return Err(self.handshake_error(&e)),
            }
        }
        Ok(input.len())
    }

    fn read_plain(&mut self, out: &mut [u8]) -> io::Result<usize> {
        match self.ssl.read(out) {
            Ok(n) => Ok(n),
            Err(e) if e.code() == ZERO_RETURN => Ok(0),
            Err(e) if self.ssl.eof() => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "TLS: the {} closed the connection without close_notify ({e})",
                    R::PEER
                ),
            )),
            Err(e) if e.code() == WANT_READ => Err(io::ErrorKind::WouldBlock.into()),
            Err(e) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("TLS: {e}"),
            )),
        }
    }

    fn write_plain(&mut self, data: &[u8]) -> io::Result<usize> {
        // A bounded piece at a time: the session is locked while it is
        // encrypted, and the reader waits for it.
        let data = &data[..data.len().min(MAX_WRITE)];
        self.ssl
            .write(data)
            .map_err(|e| io::Error::other(format!("TLS: {e}")))
    }

    fn take_sealed(&mut self, out: &mut Vec<u8>) -> io::Result<()> {
        self.ssl.take_outgoing(out);
        Ok(())
    }

    fn close_notify(&mut self) {
        // Only sends ours: the peer's may never come.
        self.ssl.shutdown();
    }

    fn describe(&self) -> String {
        format!(
            "{} {}, PSK identity {}",
            self.ssl.version(),
            self.ssl.cipher(),
            self.ssl.state().identity()
        )
    }
}
