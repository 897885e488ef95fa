"""The name server: RocketMQ's RouteInfoManager behind a remoting server (see docs/architecture.md)."""

from namesrv.config import NamesrvConfig, load_namesrv_config
from namesrv.processor import NamesrvProcessor
from namesrv.requests import InvalidRequestError, decode_topic_configs, encode_topic_configs
from namesrv.route_info import (MASTER_ID, BrokerData, ClusterInfo, EvictedNode, NodeStatus, QueueData,
                                Registration, RegisterResult, RouteConflictError, RouteInfoManager,
                                RouteStatistics, TopicConfig, TopicRouteData)
from namesrv.server import serve_namesrv

__all__ = [
    "MASTER_ID", "BrokerData", "ClusterInfo", "EvictedNode", "InvalidRequestError", "NamesrvConfig",
    "NamesrvProcessor", "NodeStatus", "QueueData", "Registration", "RegisterResult", "RouteConflictError",
    "RouteInfoManager", "RouteStatistics", "TopicConfig", "TopicRouteData", "decode_topic_configs",
    "encode_topic_configs", "load_namesrv_config", "serve_namesrv",
]
