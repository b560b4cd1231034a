//! New storage that creation made, waiting by name for the open that
//! takes it: creating an image and opening it for the copy are two steps
//! (a format writes its header through the storage creation makes, then
//! the image is opened), and storage reached over a network is better
//! handed over than opened again (an S3 object being written cannot be
//! opened again at all; an RBD image would cost another cluster
//! connection).

use std::sync::Mutex;

use diskit_core::sync::lock;

/// Storage of type `T` made and not yet opened, by name.
pub struct Waiting<T> {
    made: Mutex<Vec<(String, T)>>,
}

impl<T> Waiting<T> {
    /// None waiting.
    pub const fn new() -> Waiting<T> {
        Waiting {
            made: Mutex::new(Vec::new()),
        }
    }

    /// Keeps `storage`, made under `name`, for the open that takes it.
    pub fn keep(&self, name: String, storage: T) {
        lock(&self.made).push((name, storage));
    }

    /// Takes the storage made under `name`, if it waits.
    pub fn take(&self, name: &str) -> Option<T> {
        let mut made = lock(&self.made);
        let at = made.iter().position(|(n, _)| n == name)?;
        Some(made.remove(at).1)
    }
}
