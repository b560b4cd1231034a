//! `copy --dirty-bitmap=NAME`: an incremental copy, the loop backup tools
//! write by hand. The source is an NBD export that serves the dirty
//! bitmap as `qemu:dirty-bitmap:NAME` (qemu-nbd `-B NAME`, `diskit serve
//! image ... bitmap=NAME`); only the ranges it marks dirty are written,
//! into a destination that exists and holds the previous copy (never
//! created, never truncated).

use std::sync::Arc;

use super::{Side, io_error, nbd_err};
use crate::util::CliError;
use diskit_copy::changed::ChangedRanges;
use diskit_core::{DeviceRef, Result};
use diskit_nbd::client::uri::{NbdUri, is_nbd_uri};
use diskit_nbd::client::{BASE_ALLOCATION, NbdClient};
use diskit_nbd::server::bitmap::{DIRTY_BITMAP_PREFIX, STATE_DIRTY};

/// The dirty ranges of an export's bitmap, asked of its server.
struct BitmapContext {
    client: Arc<NbdClient>,
    context: String,
}

impl ChangedRanges for BitmapContext {
    fn changed(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>> {
        Ok(self
            .client
            .block_status(&self.context, offset, len)?
            .into_iter()
            .map(|(l, flags)| (l, flags & STATE_DIRTY != 0))
            .collect())
    }
}

/// Connects to the source export asking for its allocation and bitmap
/// `name`; fails when the server does not offer the bitmap.
pub(super) fn open_source(
    side: &Side,
    name: &str,
) -> Result<(DeviceRef, Arc<dyn ChangedRanges>), CliError> {
    let context = format!("{DIRTY_BITMAP_PREFIX}{name}");
    let contexts = [BASE_ALLOCATION, context.as_str()];
    let (client, what) = match side {
        Side::Network(uri) if is_nbd_uri(uri) => {
            let parsed = NbdUri::parse(uri).map_err(nbd_err)?;
            let client = NbdClient::connect_to(parsed, &contexts).map_err(nbd_err)?;
            (client, uri.clone())
        }
        // A server nbdcopy-style: `[ qemu-nbd -B NAME ... ]`.
        Side::Command(argv) => {
            let client = NbdClient::connect_command_to(argv, "", &contexts).map_err(nbd_err)?;
            (client, format!("[ {} ]", argv.join(" ")))
        }
        _ => {
            return Err(CliError::new(
                "--dirty-bitmap: the source must be an NBD URI or [ CMD ] (the export serving \
                 the bitmap)",
            ));
        }
    };
    let client = Arc::new(client);
    if !client.offers_context(&context) {
        return Err(CliError::new(format!(
            "{what}: the server does not offer the metadata context '{context}' \
             (is the bitmap exported? qemu-nbd -B {name}, or diskit serve image ... bitmap={name})"
        )));
    }
    let changed: Arc<dyn ChangedRanges> = Arc::new(BitmapContext {
        client: client.clone(),
        context,
    });
    Ok((client, changed))
}

/// Opens the destination as it is: an existing file or block device,
/// never truncated, or an NBD export.
pub(super) fn open_destination(side: &Side, connections: usize) -> Result<DeviceRef, CliError> {
    match side {
        Side::Local(path) => {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map_err(|e| io_error(path, &e))?;
            let ft = file.metadata().map_err(|e| io_error(path, &e))?.file_type();
            use std::os::unix::fs::FileTypeExt;
            if !(ft.is_file() || ft.is_block_device()) {
                return Err(CliError::new(format!(
                    "{path}: --dirty-bitmap: the destination must be a file or block device"
                )));
            }
            let dev = diskit_open::local::adopt_destination(file, path)
                .map_err(|e| CliError::new(format!("{path}: {e}")))?;
            Ok(dev)
        }
        Side::Network(name) => super::open_network(side, connections, true)?
            .ok_or_else(|| CliError::new(format!("{name}: cannot open the destination"))),
        _ => Err(CliError::new(
            "--dirty-bitmap: the destination must be an existing file, block device or NBD URI",
        )),
    }
}
