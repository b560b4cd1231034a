//! diskit-rbd: Ceph RBD images as storage, through librbd (Ceph's own C
//! library, `librbd.h`'s stable API), loaded at run time: a thin, safe
//! binding (`api`), QEMU's `rbd:` names ([`name`]), and an image as
//! [`diskit_core::Storage`] ([`image`]).

mod aio;
mod api;
pub mod image;
pub mod name;
mod objects;

pub use image::{RbdImage, create, remove};
pub use name::RbdName;
