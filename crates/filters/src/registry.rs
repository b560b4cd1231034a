//! How a filter is registered: one [`FilterInfo`] row in
//! [`FILTERS`](crate::FILTERS), which names the filter, lists its keys,
//! describes it and names its configuration: a [`Configure`], which takes
//! the parameters one by one and stacks the filter, so that nothing
//! outside the filter's own module knows its types. The loop over the
//! parameters, their order and the refusal of unknown keys are here, once.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use diskit_core::{BlockDevice, DeviceRef, Error, Filter, Filtered, Result};

use crate::FILTERS;

/// `key=value` parameters, in the order given.
pub type Params = [(String, String)];

/// A filter's configuration: read from its defaults and the `key=value`
/// parameters, one at a time, in the order given (a later value of a key
/// replaces an earlier one, as in nbdkit), checked together, then stacked
/// over a device.
pub trait Configure: Default + fmt::Debug + Send + Sync + Any {
    /// Takes one parameter. A key the filter does not take is refused
    /// with [`unknown`].
    fn set(&mut self, key: &str, value: &str) -> Result<()>;

    /// Checks the values together, once all are taken: nothing to check
    /// by default.
    fn finish(&self) -> Result<()> {
        Ok(())
    }

    /// Checks that `next` can do what the filter so configured passes
    /// down to it (fua, nozero), before it is stacked on `next` for a
    /// stack that will be written: one served read-only skips the check,
    /// as nbdkit skips it. Nothing to check by default.
    fn check_below(&self, next: &dyn BlockDevice) -> Result<()> {
        let _ = next;
        Ok(())
    }

    /// Stacks the filter so configured on `next`.
    fn stack(&self, next: DeviceRef) -> Result<DeviceRef>;

    /// Reads and checks the parameters.
    fn from_params(list: &Params) -> Result<Self> {
        let mut c = Self::default();
        for (k, v) in list {
            c.set(k, v)?;
        }
        c.finish()?;
        Ok(c)
    }
}

/// A checked configuration of any filter, ready to stack: what a
/// [`FilterSpec`] holds.
trait Stackable: fmt::Debug + Send + Sync + Any {
    /// Stacks the filter on `next`, checking it first unless the stack is
    /// `read_only` (see [`Configure::check_below`]).
    fn stack_on(&self, next: DeviceRef, read_only: bool) -> Result<DeviceRef>;
}

impl<C: Configure> Stackable for C {
    fn stack_on(&self, next: DeviceRef, read_only: bool) -> Result<DeviceRef> {
        if !read_only {
            self.check_below(&*next)?;
        }
        self.stack(next)
    }
}

/// The error for a parameter `key` that `filter` does not take.
pub fn unknown(filter: &str, key: &str) -> Error {
    Error::invalid(format!("{filter}: unknown parameter '{key}'"))
}

/// The configuration of a filter that takes no parameters: any key is
/// refused, and the filter `F` as it starts ([`Default`]) is stacked.
pub struct Keyless<F>(std::marker::PhantomData<fn() -> F>);

impl<F> Default for Keyless<F> {
    fn default() -> Self {
        Keyless(std::marker::PhantomData)
    }
}

impl<F> fmt::Debug for Keyless<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Keyless")
    }
}

impl<F: Filter + Default + 'static> Configure for Keyless<F> {
    fn set(&mut self, key: &str, _value: &str) -> Result<()> {
        Err(unknown(F::default().name(), key))
    }

    fn stack(&self, next: DeviceRef) -> Result<DeviceRef> {
        Ok(over(F::default(), next))
    }
}

/// A filter's row: its name, the parameter keys it takes, a one-line
/// description, what it promises and how its parameters are read.
#[derive(Debug, Clone, Copy)]
pub struct FilterInfo {
    /// The name given to `--filter=`.
    pub name: &'static str,
    /// Every key the filter takes.
    pub keys: &'static [&'static str],
    /// One line for `--help`.
    pub help: &'static str,
    /// The filter never writes to the device below (cow), so that the
    /// device below may be opened read-only, as nbdkit opens it.
    pub reads_only_below: bool,
    /// Reads and checks the parameters (only keys of
    /// [`keys`](Self::keys) are given).
    parse: fn(&Params) -> Result<Arc<dyn Stackable>>,
}

impl FilterInfo {
    /// The row of the filter `name`, which takes `keys` and is configured
    /// by a `C`.
    pub const fn new<C: Configure>(
        name: &'static str,
        keys: &'static [&'static str],
        help: &'static str,
    ) -> FilterInfo {
        FilterInfo {
            name,
            keys,
            help,
            reads_only_below: false,
            parse: parse::<C>,
        }
    }

    /// The same row for a filter that never writes below.
    pub const fn reads_only_below(self) -> FilterInfo {
        FilterInfo {
            reads_only_below: true,
            ..self
        }
    }
}

/// Reads a `C`: what a row's [`parse`](FilterInfo::parse) does.
fn parse<C: Configure>(list: &Params) -> Result<Arc<dyn Stackable>> {
    Ok(Arc::new(C::from_params(list)?))
}

/// `filter` stacked on `next`.
pub fn over<F: Filter + 'static>(filter: F, next: DeviceRef) -> DeviceRef {
    Arc::new(Filtered::new(filter, next))
}

/// The filter called `name`; an unknown name is an error listing the
/// filters there are.
pub fn info(name: &str) -> Result<&'static FilterInfo> {
    FILTERS.iter().find(|f| f.name == name).ok_or_else(|| {
        let names: Vec<&str> = FILTERS.iter().map(|f| f.name).collect();
        Error::invalid(format!(
            "unknown filter '{name}' (filters: {})",
            names.join(", ")
        ))
    })
}

/// A filter chosen by name with its parameters checked, ready to stack.
#[derive(Debug, Clone)]
pub struct FilterSpec {
    info: &'static FilterInfo,
    config: Arc<dyn Stackable>,
}

impl FilterSpec {
    /// The filter `name` with `params` (key, value), applied in order (a
    /// later value of a key replaces an earlier one, as in nbdkit).
    pub fn parse(name: &str, params: &Params) -> Result<FilterSpec> {
        let info = info(name)?;
        if let Some((k, _)) = params
            .iter()
            .find(|(k, _)| !info.keys.contains(&k.as_str()))
        {
            return Err(unknown(name, k));
        }
        let config = (info.parse)(params)?;
        Ok(FilterSpec { info, config })
    }

    /// The filter's name.
    pub fn name(&self) -> &'static str {
        self.info.name
    }

    /// See [`FilterInfo::reads_only_below`].
    pub fn reads_only_below(&self) -> bool {
        self.info.reads_only_below
    }

    /// The configuration, when it is a `C` (the filter module's type).
    pub fn config<C: Configure>(&self) -> Option<&C> {
        let any: &dyn Any = &*self.config;
        any.downcast_ref()
    }

    /// Stacks the filter on `next`. `read_only`: the stack will be served
    /// read-only (see [`Configure::check_below`]).
    pub fn stack(&self, next: DeviceRef, read_only: bool) -> Result<DeviceRef> {
        self.config.stack_on(next, read_only)
    }
}

/// Stacks `filters` over `device`: the first is the outermost (closest to
/// the client), the last sits directly on `device`.
pub fn stack(filters: &[FilterSpec], device: DeviceRef, read_only: bool) -> Result<DeviceRef> {
    filters
        .iter()
        .rev()
        .try_fold(device, |next, f| f.stack(next, read_only))
}
