//! Finding an image in a backing chain by the name a user gives.

use std::path::Path;

use crate::Image;
use crate::implied::Role;
use diskit_core::storage::resolve_relative;

impl Image {
    /// The position in [`Image::chain`] (1 or more: never this image) of the
    /// backing file named `name`, as QEMU finds it: the name as recorded in
    /// the image above it, or a path (relative to that image's directory)
    /// to the same file.
    pub fn find_backing(&self, name: &str) -> Option<usize> {
        let chain = self.chain();
        let same_file = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        };
        (1..chain.len()).find(|&i| {
            let above = chain[i - 1];
            let recorded = above
                .implied_names()
                .into_iter()
                .find(|n| n.role == Role::Backing);
            recorded.is_some_and(|n| n.name == name)
                || same_file(
                    Path::new(&resolve_relative(&above.filename.to_string_lossy(), name)),
                    &chain[i].filename,
                )
        })
    }
}
