//! What the client tests share: one asynchronous read sent the way the
//! block layer sends it.

use diskit_core::CompletionQueue;
use diskit_core::buffer::AlignedBuf;
use diskit_nbd::client::conn::{Connection, Group, Piece};
use diskit_nbd::proto::consts::CMD_READ;

/// Sends one 4 KiB READ of offset 0 on `conn`, into a buffer of its own;
/// its completion arrives on the returned queue.
pub fn send_read(conn: &Connection) -> CompletionQueue {
    let cq = CompletionQueue::new();
    let group = Group::new(
        1,
        Some(AlignedBuf::new(4096, 512).unwrap()),
        Some((cq.clone(), 1)),
    );
    let piece = Piece {
        command: CMD_READ,
        flags: 0,
        offset: 0,
        length: 4096,
        at: 0,
    };
    conn.send(&group, &[piece], None);
    group.release(None);
    cq
}
