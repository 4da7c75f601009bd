//! `run.device`: what it may name and how a stage opens it.

use candle_core::Device;

use crate::config::Config;

/// What `run.device` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceName {
    /// The host.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

/// Parses `run.device` ("cpu", "cuda", "cuda:N") without opening anything.
pub fn parse(d: &str) -> anyhow::Result<DeviceName> {
    match d {
        "cpu" => Ok(DeviceName::Cpu),
        "cuda" => Ok(DeviceName::Cuda(0)),
        _ => match d.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(DeviceName::Cuda(n)),
            _ => anyhow::bail!("`run.device` = {d:?} is not a device: use \"cpu\" or \"cuda:N\""),
        },
    }
}

/// Opens the device `run.device` names.
pub fn open(c: &Config) -> anyhow::Result<Device> {
    match parse(&c.run.device)? {
        DeviceName::Cpu => Ok(Device::Cpu),
        DeviceName::Cuda(n) => {
            anyhow::bail!("`run.device` = \"cuda:{n}\": this binary was built without CUDA support (build with `--features cuda`)")
        }
    }
}
